"""Submitting caption jobs and reading their results. Imports neither torch nor transformers."""

from wicore.producer.client import Producer
from wicore.producer.outcome import Outcome
from wicore.producer.shards import ShardedProducer, shard_of
from wicore.producer.submission import ProducerConfig, Submission

__all__ = ["Outcome", "Producer", "ProducerConfig", "ShardedProducer", "Submission", "shard_of"]
