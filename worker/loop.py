"""The batching worker: take jobs from the bucket queues while the engine has room, step the
engine, write each job's result the moment its sequence ends.

    while running:
        cancel()       # jobs canceled while in hand leave the engine at this step boundary
        admit()        # scheduler picks a bucket; claim, start, load images, engine.add
        step()         # engine.step(); finish what ended
        or idle()      # nothing to do: wait on the doorbell

The worker never forks: the model loads once per process (rq's SimpleWorker idea).
SIGTERM/SIGINT once = warm shutdown (take nothing new, finish what is in hand); twice = cold
(give claimed jobs back to their queues now).
"""

from __future__ import annotations

import json
import logging
import signal
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from pydantic import ValidationError
from redis import Redis
from rq.serializers import JSONSerializer

from wicore import defaults, keys
from wicore.engines.base import ABORTED, Completion, Engine
from wicore.errors import DeadlineExceeded, ShutdownRequested
from wicore.scheduler.policy import BatchPolicy, Take, Wait, choose, split_expired
from wicore.scheduler.queues import BucketQueues
from wicore.schemas import CaptionJob, Timings
from wicore.worker.batch_log import BatchLog
from wicore.worker.job_inputs import InputConfig, InputLoader, Loaded
from wicore.worker.liveness import Heartbeat, reap_dead_workers
from wicore.worker.metrics import WorkerMetrics
from wicore.worker.results import caption_result
from wicore.worker.rq_bridge import Claimed, Finished, RQBridge, RQWorkerRecord

log = logging.getLogger(__name__)

CANCELS_PER_TAKE = 1024  # cancel requests read per loop iteration (the rest wait for the next)


@dataclass(frozen=True)
class WorkerConfig:
    model_id: str
    name: str | None = None
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    inputs: InputConfig = field(default_factory=InputConfig)
    liveness_ttl_s: float = defaults.LIVENESS_TTL_S  # a worker silent this long is dead; its jobs are requeued
    heartbeat_s: float = 3.0
    reap_every_s: float = 5.0
    idle_wait_s: float = 1.0  # longest doorbell wait before looking at the queues again
    result_ttl_s: int = defaults.RESULT_TTL_S
    burst: bool = False  # exit once the queues are empty and the engine is idle
    max_jobs: int | None = None  # exit after this many jobs ended (tests, benchmarks)


@dataclass
class InFlight:
    claimed: Claimed
    payload: CaptionJob
    loading: Future[Loaded] | None = None  # the image, until it reaches the engine
    preprocess_s: float = 0.0


class BatchingWorker:
    def __init__(self, connection: Redis, engine: Engine, config: WorkerConfig):
        self.connection = connection
        self.engine = engine
        self.config = config
        self.record = RQWorkerRecord([], name=config.name, connection=connection, serializer=JSONSerializer)
        self.bridge = RQBridge(self.record, result_ttl=config.result_ttl_s)
        self.queues = BucketQueues(connection, config.model_id)
        self.inputs = InputLoader(connection, config.inputs)
        self.heartbeat = Heartbeat(self.record, heartbeat_s=config.heartbeat_s, ttl_s=config.liveness_ttl_s)
        self.in_flight: dict[str, InFlight] = {}
        self.metrics = WorkerMetrics(config.model_id)
        self.batch_log = BatchLog()
        self.jobs_done = 0
        self.stopping = False
        self._next_reap = 0.0

    @property
    def name(self) -> str:
        return self.record.name

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Work until stopped (or, in burst mode, until the queues are empty). Returns the
        number of jobs that ended here."""
        self._start()
        try:
            while not (self.stopping and not self.in_flight):
                self._maintain()
                self._cancel()
                admitted = self._admit() if not self.stopping else False
                self._hand_over_loaded()
                if self.engine.num_unfinished():
                    self._finish(self._step())
                elif self._loading():
                    wait([f.loading for f in self._loading()], timeout=0.01, return_when=FIRST_COMPLETED)
                elif not admitted and not self._idle():
                    break
        except ShutdownRequested:
            log.warning("worker %s: cold shutdown, returning %d jobs to their queues", self.name, len(self.in_flight))
        finally:
            self._stop()
        return self.jobs_done

    def _start(self) -> None:
        self.record.register_birth()
        self.heartbeat.beat()
        self.heartbeat.start()
        self._install_signal_handlers()
        self.bridge.requeue_claims(self.bridge.claims_key)  # a previous life under this name
        log.info("worker %s: serving model %s on engine %s", self.name, self.config.model_id, self.engine.name)

    def _stop(self) -> None:
        self.heartbeat.stop()
        self._publish_stats()
        self.bridge.requeue_claims(self.bridge.claims_key)
        self.connection.srem(keys.CLAIMANTS, self.name)
        self.record.register_death()
        self.inputs.close()

    def _maintain(self) -> None:
        """Every `reap_every_s`: requeue dead workers' jobs, publish our engine's counters."""
        if time.monotonic() < self._next_reap:
            return
        reap_dead_workers(self.connection, self.bridge)
        self._publish_stats()
        self._next_reap = time.monotonic() + self.config.reap_every_s

    def _step(self) -> list[Completion]:
        batch, start = self.engine.num_unfinished(), time.perf_counter()
        done = self.engine.step()
        self.metrics.stepped(batch, time.perf_counter() - start)
        self.metrics.in_hand(self.engine.num_unfinished(), len(self._loading()))
        return done

    def _publish_stats(self) -> None:
        identity = {"model": self.config.model_id, "engine": self.engine.name}
        identity |= {"device": self.engine.config.device, "dtype": self.engine.config.dtype}
        stats = {**identity, "jobs_done": self.jobs_done, "in_flight": len(self.in_flight), **self.engine.stats()}
        self.metrics.engine_snapshot(stats)
        self.metrics.in_hand(self.engine.num_unfinished(), len(self._loading()))
        self.connection.set(keys.stats(self.name), json.dumps(stats), ex=max(60, int(self.config.liveness_ttl_s * 4)))

    def _idle(self) -> bool:
        """Nothing in hand and nothing taken: wait for the doorbell. False ends the loop."""
        if self.config.max_jobs is not None and self.jobs_done >= self.config.max_jobs:
            return False
        if self.config.burst and not self.queues.heads():
            return False
        self._wait_for_work(self.config.idle_wait_s)
        return True

    def _wait_for_work(self, seconds: float) -> None:
        # Redis reads a timeout under 1 ms as 0, which would block forever.
        self.connection.blpop([keys.doorbell(self.config.model_id)], timeout=max(seconds, 0.002))

    # -- canceling jobs -----------------------------------------------------------------------

    def _cancel(self) -> None:
        """Jobs RQ canceled while this worker held them (`Producer.cancel` names them in our
        cancel set). One still loading its image ends now; one in the engine is aborted there
        and ends when the engine returns it, at once or from a later step (`Engine.abort`). Either
        ends canceled, with no result. One SPOP a loop iteration while jobs are in hand."""
        if not self.in_flight:
            return
        taken = {raw.decode() for raw in self.connection.spop(keys.cancel(self.name), CANCELS_PER_TAKE) or []}
        held = [self.in_flight[job_id] for job_id in taken if job_id in self.in_flight]
        loading = [flight for flight in held if flight.loading is not None]
        for flight in loading:
            flight.loading.cancel()  # a load already running ends unread: the job leaves `in_flight`
            self.in_flight.pop(flight.claimed.id)
        self._end([Finished(flight.claimed, canceled=True) for flight in loading])
        in_engine = [flight.claimed.id for flight in held if flight.loading is None]
        if in_engine:
            self._finish(self.engine.abort(in_engine))
        if held:
            log.info("worker %s: canceling %d jobs in hand", self.name, len(held))

    # -- taking jobs --------------------------------------------------------------------------

    def _admit(self) -> bool:
        """Fill the engine's free slots from the bucket the policy picks. True if jobs came in."""
        if self.config.max_jobs is not None and self.jobs_done + len(self.in_flight) >= self.config.max_jobs:
            return False
        capacity = self.engine.free_slots() - len(self._loading())
        if self.config.max_jobs is not None:
            capacity = min(capacity, self.config.max_jobs - self.jobs_done - len(self.in_flight))
        self.record.set_queue_names(self.queues.names())
        decision = choose(self.queues.heads(), capacity, self.config.policy, time.time())
        if isinstance(decision, Wait) and not self.in_flight:
            self._wait_for_work(min(decision.seconds, self.config.idle_wait_s))
        if not isinstance(decision, Take):
            return False
        claimed = self.bridge.claim(decision.queue_name, decision.count)
        self.batch_log.claimed(claimed)
        self._submit(claimed)
        return bool(claimed)

    def _submit(self, claimed: list[Claimed]) -> None:
        """Jobs that cannot run (bad payload, deadline passed) fail here, unrun; the rest have
        their images loaded in the background (the engine keeps running meanwhile)."""
        payloads, invalid = parse_payloads(claimed)
        live, expired = split_expired(payloads, lambda cp: cp[1].deadline, time.time())
        reasons = invalid + [(c, deadline_message(p)) for c, p in expired]
        unrunnable = [Finished(c, error=reason) for c, reason in reasons]
        self._end(unrunnable)
        self.metrics.failed("input", len(unrunnable))
        futures = self.inputs.submit([(c.id, payload) for c, payload in live])
        for (c, payload), future in zip(live, futures):
            self.in_flight[c.id] = InFlight(c, payload, loading=future)

    def _loading(self) -> list[InFlight]:
        return [f for f in self.in_flight.values() if f.loading is not None]

    def _hand_over_loaded(self) -> None:
        """Jobs whose image is ready go to the engine in one `add`; a bad image fails its job
        alone."""
        bad, requests = [], []
        for flight in self._loading():
            if not flight.loading.done():
                continue
            loaded = flight.loading.result()
            flight.loading, flight.preprocess_s = None, loaded.preprocess_s
            if loaded.error is not None:
                bad.append(Completion(flight.claimed.id, error=loaded.error, input_error=True))
            else:
                requests.append(loaded.request)
        if bad or requests:
            self.metrics.admitted(sum(len(r.images) for r in requests))
            self._finish(bad + (self.engine.add(requests) if requests else []))

    # -- finishing jobs -----------------------------------------------------------------------

    def _finish(self, completions: list[Completion]) -> None:
        self._end([self._finished(c) for c in completions if c.id in self.in_flight])

    def _end(self, items: list[Finished]) -> None:
        self.bridge.finish(items)
        self.batch_log.ended(items)
        self.jobs_done += len(items)
        self.metrics.canceled(sum(item.canceled for item in items))

    def _finished(self, completion: Completion) -> Finished:
        flight = self.in_flight.pop(completion.id)
        if completion.error == ABORTED:  # only `_cancel` aborts: RQ reads the job canceled already
            return Finished(flight.claimed, canceled=True)
        if not completion.ok:
            self.metrics.failed("input" if completion.input_error else "transient")
            return Finished(flight.claimed, error=completion.error, retry=not completion.input_error)
        submitted = flight.payload.submitted_at
        timings = Timings(
            queued_s=max(0.0, flight.claimed.started_at - submitted),
            preprocess_s=flight.preprocess_s,
            engine_s=completion.engine_s,
            total_s=max(0.0, time.time() - submitted),
        )
        result = caption_result(
            completion, timings, worker=self.name, engine=self.engine.name, model=self.config.model_id
        )
        self.metrics.succeeded(completion, timings)
        return Finished(flight.claimed, result=result.model_dump(mode="json"))

    # -- signals ------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        if self.stopping:
            raise ShutdownRequested()
        log.info("worker %s: warm shutdown (signal again to stop now)", self.name)
        self.stopping = True


def parse_payloads(claimed: list[Claimed]) -> tuple[list[tuple[Claimed, CaptionJob]], list[tuple[Claimed, str]]]:
    """(valid, invalid-with-reason): a payload that fails validation fails its job alone."""
    valid, invalid = [], []
    for c in claimed:
        try:
            valid.append((c, CaptionJob.model_validate(c.args[0])))
        except (ValidationError, IndexError, TypeError) as exc:
            first_line = str(exc).splitlines()[0]
            invalid.append((c, f"InvalidJob: payload is not a wicore caption job ({first_line})"))
    return valid, invalid


def deadline_message(payload: CaptionJob) -> str:
    late = time.time() - (payload.deadline or 0.0)
    return f"{DeadlineExceeded.__name__}: deadline passed {late:.3f}s before a worker could start it; not run"
