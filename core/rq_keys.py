"""RQ's key prefixes, read from RQ's own classes (RQ_KEY_PREFIX moves them all), for the code
that writes RQ's records without RQ's Python: the Lua scripts (their `LUA_PREAMBLE`) and a few
pipelines. tests/test_rq_keys.py pins each against the key RQ itself computes."""

from __future__ import annotations

from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, Execution, ExecutionRegistry
from rq.job import Job
from rq.queue import Queue
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.worker import BaseWorker
from rq.worker_registration import REDIS_WORKER_KEYS

JOB = Job.redis_job_namespace_prefix  # + job id: the job hash
QUEUE = Queue.redis_queue_namespace_prefix  # + queue name: the list of queued ids
QUEUES = Queue.redis_queues_keys  # the set of every queue key
RESULTS = Result.get_key("")  # + job id: the result stream
EXECUTIONS = ExecutionRegistry.key_template.format("")  # + job id: the job's execution ids
EXECUTION = Execution("E", "J", connection=None).key.removesuffix("J:E")  # type: ignore[arg-type]  # + 'job id:execution id': its hash
STARTED = StartedJobRegistry.key_template.format("")  # + queue name: running executions (RQ calls it wip)
FINISHED = FinishedJobRegistry.key_template.format("")  # + queue name
FAILED = FailedJobRegistry.key_template.format("")  # + queue name
CANCELED = CanceledJobRegistry.key_template.format("")  # + queue name
DEFERRED = DeferredJobRegistry.key_template.format("")  # + queue name
SCHEDULED = ScheduledJobRegistry.key_template.format("")  # + queue name
WORKER = BaseWorker.redis_worker_namespace_prefix  # + worker name: the worker hash
WORKERS = REDIS_WORKER_KEYS  # the set of every worker key

# Lua names -> prefixes, for `LUA_PREAMBLE`.
_LUA_NAMES = {
    "job": JOB,
    "queue": QUEUE,
    "queues": QUEUES,
    "results": RESULTS,
    "executions": EXECUTIONS,
    "execution": EXECUTION,
    "started": STARTED,
    "finished": FINISHED,
    "failed": FAILED,
    "canceled": CANCELED,
    "deferred": DEFERRED,
    "scheduled": SCHEDULED,
}


def _lua_table(names: dict[str, str]) -> str:
    # RQ allows only [A-Za-z0-9_.:{}-] in its prefix: safe inside a single-quoted Lua string.
    return "local RQ = {" + ", ".join(f"{name} = '{prefix}'" for name, prefix in names.items()) + "}\n"


# The first line of every script that writes RQ's records: `RQ.job .. id` is RQ's key of a job hash.
LUA_PREAMBLE = _lua_table(_LUA_NAMES)


def worker_executions(worker: str) -> str:
    """The set of a worker's running executions ('job id:execution id')."""
    return WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker)
