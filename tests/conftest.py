"""Shared fixtures: a real redis-server (embedded, or REDIS_URL), two as the shards of one deployment, a
tiny Gemma-3 checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from wicore.embedded import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server_url():
    """REDIS_URL when set (a throwaway database!), else one embedded redis-server per session."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server_url):
    """A flushed database for each test."""
    connection = redis.Redis.from_url(redis_server_url)
    connection.flushdb()
    yield redis_server_url
    connection.flushdb()
    connection.close()


@pytest.fixture
def redis_conn(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def shard_urls():
    """Two embedded redis-servers, the shards of one deployment, per test module."""
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        yield [a.url, b.url]


@pytest.fixture
def shards(shard_urls):
    """A connection to each shard, flushed for each test."""
    connections = [redis.Redis.from_url(url) for url in shard_urls]
    for connection in connections:
        connection.flushdb()
    yield connections
    for connection in connections:
        connection.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Gemma-3 checkpoint (random weights, local tokenizer), built once per session."""
    from wicore.models.gemma3 import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def fast_engine(tiny_model_dir):
    """The tiny model on the fast engine: 4 sequences, no caches, one torch thread (two OpenMP
    threads on a busy 2-core machine slow each step tenfold)."""
    from wicore.engines.base import EngineConfig
    from wicore.engines.fast import FastEngine
    from wicore.engines.options import FastOptions

    engine = FastEngine(
        EngineConfig(str(tiny_model_dir), max_batch_size=4, cache=False, options=FastOptions(torch_threads=1))
    )
    yield engine
    engine.close()
