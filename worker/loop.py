"""The batching worker: take jobs from the bucket queues while the engine has room, step the
engine, write each job's result the moment its sequence ends.

    while running:
        cancel()       # jobs canceled while in hand leave the engine at this step boundary
        admit()        # scheduler picks a bucket; claim, start, load images, engine.add
        step()         # engine.step(); finish what ended
        or idle()      # nothing to do: wait on the doorbell
        flush()        # write the results of this turn

The worker never forks: the model loads once per process (rq's SimpleWorker idea).
SIGTERM/SIGINT once = warm shutdown (take nothing new, finish what is in hand); twice = cold
(give claimed jobs back to their queues now).

When Redis goes away, or refuses writes (over its maxmemory, a read-only replica, failing to
persist: `redis_link.is_outage`), the worker keeps stepping the engine on the jobs in hand, holds
their results in memory and knocks on Redis with backoff and jitter (a write: a PING answers while
writes are refused); once it takes writes again, the worker re-registers, writes the held results
(a run written before is skipped: the write is idempotent by run) and gives back any claim it does
not hold (`_reconcile`). `state` says "waiting for Redis" meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from concurrent.futures import wait

from redis import Redis
from redis.exceptions import RedisError
from rq.serializers import JSONSerializer

from wicore import keys
from wicore.engines.base import ABORTED, Completion, Engine
from wicore.errors import ShutdownRequested
from wicore.gc_pauses import PAUSES
from wicore.scheduler.policy import Take, Wait, choose, split_expired
from wicore.scheduler.queues import BucketQueues
from wicore.worker import token_streams
from wicore.worker.batch_log import BatchLog
from wicore.worker.engine_gate import EngineGate
from wicore.worker.job_inputs import InputLoader, deadline_message, parse_payloads
from wicore.worker.liveness import Heartbeat, reap_dead_workers, take_over_name
from wicore.worker.metrics import WorkerMetrics
from wicore.worker.redis_link import Backoff, PollPace, is_outage, outage_text
from wicore.worker.results import caption_result, job_timings
from wicore.worker.rq_bridge import Claimed, Finished, RQBridge, RQWorkerRecord
from wicore.worker.status import publish_stats
from wicore.worker.worker_config import InFlight, WorkerConfig, WorkerState, loads_to_wait_for, overtaking_loads

log = logging.getLogger(__name__)

CANCELS_PER_TAKE = 1024  # cancel requests read per loop iteration (the rest wait for the next)
REDIS_TIMEOUT_TICK_S = 0.1  # how finely Redis (hz 10, its default) ends BLPOP timeouts
PROBE_TTL_MS = 1000  # the key an outage's write test sets expires by itself


class BatchingWorker:
    def __init__(self, connection: Redis, engine: Engine, config: WorkerConfig):
        self.connection = connection
        self.engine = engine
        self.config = config
        self.record = RQWorkerRecord([], name=config.name, connection=connection, serializer=JSONSerializer)
        self.bridge = RQBridge(self.record, result_ttl=config.result_ttl_s)
        self.queues = BucketQueues(connection, config.model_id)
        self.inputs = InputLoader(connection, config.inputs, engine.pixel_spec(), engine.image_size())
        self.heartbeat = Heartbeat(self.record, heartbeat_s=config.heartbeat_s, ttl_s=config.liveness_ttl_s)
        self.gate = EngineGate(engine)
        # By run (`Claimed.run`): a job canceled and submitted again may be in hand twice.
        self.in_flight: dict[str, InFlight] = {}
        self.unwritten: list[Finished] = []  # ended here, not yet written to Redis
        self.metrics = WorkerMetrics(config.model_id)
        self.batch_log = BatchLog()
        self.cancel_polls = PollPace()
        self.jobs_done = 0
        self.stopping = False
        self.state = WorkerState.STARTING
        self._batches = itertools.count()
        self._next_maintenance = 0.0
        self._published_jobs = 0  # jobs_done when the stats were last published
        self._reap_after = 0.0  # after an outage, others get a TTL to beat again before we reap

    @property
    def name(self) -> str:
        return self.record.name

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Work until stopped (or, in burst mode, until the queues are empty). Returns the
        number of jobs that ended here."""
        self._start()
        try:
            while not (self.stopping and not self.in_flight and not self.unwritten):
                try:
                    if not self._turn():
                        break
                except RedisError as exc:
                    if not is_outage(exc):
                        raise
                    self._ride_out(exc)
        except ShutdownRequested:
            log.warning("worker %s: cold shutdown, returning %d jobs to their queues", self.name, len(self.in_flight))
        finally:
            self._stop()
        return self.jobs_done

    def _turn(self) -> bool:
        """One pass of the loop; False when the worker is done (burst, max_jobs, stopped)."""
        self._maintain()
        self._cancel()
        self._fetch_images()
        admitted = self._admit() if not self.stopping else False
        going = self._work() or admitted or (not self.stopping and self._idle())
        self._publish_text()
        self._flush()
        return going

    def _work(self) -> bool:
        """Feed loaded jobs to the engine, step it, or wait for images, all without Redis.
        While a better lane's images load, the engine waits for them rather than start another
        lane's work (a prefill, a vision batch) ahead of them. False when there was nothing to do."""
        self._hand_over_loaded()
        overtaking = overtaking_loads(self.in_flight.values())
        if self.gate.busy() and not overtaking:
            self._collect(self._step())
        elif loading := self._loading():
            wait(loads_to_wait_for(loading, overtaking), timeout=0.01)
        else:
            return False
        return True

    def _step(self) -> list[Completion]:
        batch, start = self.engine.num_unfinished(), time.perf_counter()
        done = self.gate.step()
        self.cancel_polls.stepped = True
        self.metrics.stepped(batch, time.perf_counter() - start)
        self.metrics.in_hand(self.engine.num_unfinished(), len(self._loading()))
        return done

    def _start(self) -> None:
        self._install_signal_handlers()
        self._register()
        self.heartbeat.start()
        self.bridge.requeue(self.bridge.claims_key, died=True)  # a previous life under this name
        self._reap_after = time.monotonic() + self.config.liveness_ttl_s
        self.state = WorkerState.READY
        log.info("worker %s: serving model %s on engine %s", self.name, self.config.model_id, self.engine.name)

    def _register(self) -> None:
        take_over_name(self.record, wait_s=self.config.liveness_ttl_s + self.config.heartbeat_s)
        self.record.register_birth()
        self.heartbeat.beat()

    def _stop(self) -> None:
        self.state = WorkerState.STOPPING
        self.heartbeat.stop()
        try:
            self._flush()
            self._publish_stats()
            self.bridge.requeue(self.bridge.claims_key, died=False)
            self.connection.srem(keys.CLAIMANTS, self.name)
            self.record.register_death()
        except RedisError as exc:
            if not is_outage(exc):
                raise
            log.warning(
                "worker %s: %s at shutdown; %d results not written, their jobs go back to their "
                "queues when this worker's record expires",
                self.name, outage_text(exc), len(self.unwritten),
            )  # fmt: skip
        finally:
            self.inputs.close()

    def _maintain(self) -> None:
        """Every `maintain_every_s`, and at once when the heartbeat registered this worker again
        (its record was lost): give back claims we do not hold, requeue dead workers' jobs, prune
        expired registry entries, publish our identity and engine's counters (also on going idle)."""
        registered_again = self.heartbeat.take_registered_again()
        if time.monotonic() < self._next_maintenance and not registered_again:
            return
        self._reconcile()
        if time.monotonic() >= self._reap_after:
            reap_dead_workers(self.connection, self.bridge)
        self.bridge.prune_registries(self.queues.names())
        self._publish_stats()
        self._next_maintenance = time.monotonic() + self.config.maintain_every_s

    def _reconcile(self) -> None:
        """Claims in our list that we do not hold (a claim whose reply was lost, a write Redis
        lost in a crash) go back to the head of their queues, no retry spent."""
        held = set(self.in_flight) | {item.claimed.run for item in self.unwritten}
        orphans = [run for run in self.bridge.claimed_runs() if run not in held]
        if orphans:
            count = self.bridge.requeue(self.bridge.claims_key, orphans, died=False)
            log.warning("worker %s: gave back %d claimed jobs it did not hold", self.name, count)

    def _publish_stats(self) -> None:
        identity = {"model": self.config.model_id, "engine": self.engine.name}
        identity |= {"device": self.engine.config.device, "dtype": self.engine.config.dtype}
        stats = {**identity, "jobs_done": self.jobs_done, "in_flight": len(self.in_flight), **self.engine.stats()}
        stats |= PAUSES.report()  # {} unless `wicore worker` installed it
        self.metrics.engine_snapshot(stats)
        self.metrics.in_hand(self.engine.num_unfinished(), len(self._loading()))
        publish_stats(self.connection, self.name, stats, self.config.liveness_ttl_s)
        self._published_jobs = self.jobs_done

    def _idle(self) -> bool:
        """Nothing in hand and nothing taken: wait for the doorbell. False ends the loop."""
        if self.config.max_jobs is not None and self.jobs_done >= self.config.max_jobs:
            return False
        if self.config.burst and not self.queues.heads():
            return False
        if self.jobs_done != self._published_jobs:  # `wicore status` shows the work just ended
            self._publish_stats()
        self._wait_for_work(self.config.idle_wait_s)
        return True

    def _wait_for_work(self, seconds: float) -> None:
        """Block on the doorbell; a wait shorter than Redis's timeout tick (a ripening batch)
        sleeps instead: a 20 ms BLPOP lasts up to 100 ms (Redis ends it on its cron)."""
        if seconds < REDIS_TIMEOUT_TICK_S:
            time.sleep(max(seconds, 0.0))
            return
        self.connection.blpop([keys.doorbell(self.config.model_id)], timeout=seconds)

    # -- canceling jobs -----------------------------------------------------------------------

    def _cancel(self) -> None:
        """Jobs canceled while this worker held them (`Producer.cancel` names their runs in our
        cancel set; a request for a run no longer in hand is dropped). One not yet in the engine
        (its image unread or loading) ends now; one in the engine gate is aborted there
        (`EngineGate.abort`: a request waiting in the gate stops at once, one in the engine at once
        or from a later step) and ends when it comes back. Either ends canceled, with no result.
        One SPOP per engine step while jobs are in hand (every 50 ms while they only load:
        `PollPace`); a failed SPOP is an outage like any other (a request lost with its reply
        costs only work: the settle script writes no result for a canceled job)."""
        if not (self.in_flight and self.cancel_polls.due()):
            return
        taken = {raw.decode() for raw in self.connection.spop(keys.cancel(self.name), CANCELS_PER_TAKE) or []}
        held = [self.in_flight[run] for run in taken if run in self.in_flight]
        before_engine = [flight for flight in held if flight.loading is not None or not flight.fetched]
        for flight in before_engine:
            if flight.loading is not None:
                flight.loading.cancel()  # a load already running ends unread: the job leaves `in_flight`
            self.in_flight.pop(flight.claimed.run)
        self._end([Finished(flight.claimed, canceled=True) for flight in before_engine])
        in_engine = [flight.claimed.run for flight in held if flight.loading is None and flight.fetched]
        if in_engine:
            self._collect(self.gate.abort(in_engine))
        if held:
            log.info("worker %s: canceling %d jobs in hand", self.name, len(held))

    # -- riding out a Redis outage ------------------------------------------------------------

    def _ride_out(self, error: Exception) -> None:
        """Keep the engine going on the jobs in hand, results held, until Redis takes writes again."""
        self.state = WorkerState.WAITING_FOR_REDIS
        log.warning("worker %s: %s; waiting for it", self.name, outage_text(error))
        lost_at, backoff = time.monotonic(), Backoff()
        while True:
            self._work_until_redis_answers(backoff)
            try:
                return self._reconnected(time.monotonic() - lost_at)
            except RedisError as exc:  # gone again before we were through
                if not is_outage(exc):
                    raise

    def _work_until_redis_answers(self, backoff: Backoff) -> None:
        """Step the engine between tries; the first try of an outage comes at once, a try after
        a failed reconnection one backoff step later."""
        next_try = time.monotonic() + backoff.next() if backoff.tries else 0.0
        while True:
            if time.monotonic() >= next_try:
                if self._redis_answers():
                    return
                next_try = time.monotonic() + backoff.next()
            if not self._work():
                time.sleep(max(0.0, next_try - time.monotonic()))

    def _redis_answers(self) -> bool:
        """Redis takes a write (a PING would answer while writes are refused)."""
        try:
            return bool(self.connection.set(keys.probe(self.name), b"1", px=PROBE_TTL_MS))
        except RedisError as exc:
            if not is_outage(exc):
                raise
            return False

    def _reconnected(self, down_s: float) -> None:
        self.heartbeat.keep_registered()
        written = self.bridge.finish(self.unwritten)
        held, self.unwritten = len(self.unwritten), []
        self._fetch_images()
        self._reconcile()
        # Workers that lost Redis together come back within a TTL plus one backoff step.
        self._reap_after = time.monotonic() + self.config.liveness_ttl_s + Backoff.most_s + 1
        self.state = WorkerState.STOPPING if self.stopping else WorkerState.READY
        log.warning(
            "worker %s: Redis is back after %.1fs; wrote %d of %d held results "
            "(the rest had moved on: requeued, or canceled)",
            self.name, down_s, written, held,
        )  # fmt: skip

    # -- taking jobs --------------------------------------------------------------------------

    def _admit(self) -> bool:
        """Fill the engine's free slots from the bucket the policy picks (the high lane may take
        the slots `BatchPolicy.high_lane_slots` keeps from the others). True if jobs came in, or
        a partial batch is ripening: the loop comes back for it rather than idling."""
        wanted = self.config.jobs_wanted(self.jobs_done, len(self.in_flight))
        if wanted <= 0:
            return False
        capacity = self.gate.free_slots() - len(self._before_engine())  # the engine's room: lanes share it
        self.record.set_queue_names(self.queues.names())
        if capacity <= 0:  # no room: reading the queue heads would cost a Redis call per step for nothing
            return False
        decision = choose(self.queues.heads(), capacity, self.config.policy, time.time())
        if isinstance(decision, Wait):
            if not self.in_flight:
                self._wait_for_work(min(decision.seconds, self.config.idle_wait_s))
            return True
        if not isinstance(decision, Take):
            return False
        claimed = self.bridge.claim(decision.queue_name, min(decision.count, wanted))
        self.batch_log.claimed(claimed)
        self._submit(claimed)
        return bool(claimed)

    def _submit(self, claimed: list[Claimed]) -> None:
        """Jobs that cannot run (bad record or payload, deadline passed) fail here, unrun; the
        rest have their images loaded in the background (the engine keeps running meanwhile)."""
        payloads, invalid = parse_payloads(claimed)
        live, expired = split_expired(payloads, lambda cp: cp[1].deadline, time.time())
        invalid += [(c, deadline_message(payload)) for c, payload in expired]
        self._end([Finished(c, error=reason) for c, reason in invalid])
        self.metrics.failed("input", len(invalid))
        group = self.engine.handover_size()
        for index, (c, payload) in enumerate(live):
            if index % group == 0:
                batch = next(self._batches)
            self.in_flight[c.run] = InFlight(c, payload, batch)
        self._fetch_images()

    def _fetch_images(self) -> None:
        """Start loading the images of jobs in hand that have none yet (one MGET for the blobs):
        the jobs just claimed, or after an outage the ones claimed just before it."""
        unfetched = [f for f in self.in_flight.values() if not f.fetched]
        if not unfetched:
            return
        futures = self.inputs.submit([(f.claimed.run, f.payload) for f in unfetched])  # engine requests are runs
        for flight, future in zip(unfetched, futures):
            flight.fetched, flight.loading = True, future

    def _loading(self) -> list[InFlight]:
        return [f for f in self.in_flight.values() if f.loading is not None]

    def _before_engine(self) -> list[InFlight]:
        return [f for f in self.in_flight.values() if f.loading is not None or not f.fetched]

    def _hand_over_loaded(self) -> None:
        """The jobs of a handover group (`Engine.handover_size` of a claim) go to the engine together,
        once all their images are ready; a bad image fails its job alone."""
        loading = self._loading()
        unready = {f.batch for f in self._before_engine() if f.loading is None or not f.loading.done()}
        bad, requests = [], []
        for flight in loading:
            if flight.batch in unready:
                continue
            loaded = flight.loading.result()
            flight.loading, flight.preprocess_s = None, loaded.preprocess_s
            if loaded.error is not None:
                bad.append(Completion(flight.claimed.run, error=loaded.error, input_error=True))
            else:
                requests.append(loaded.request)
        if bad or requests:
            self.metrics.admitted(sum(len(r.images) for r in requests))
            self._collect(bad + (self.gate.add(requests) if requests else []))

    # -- finishing jobs -----------------------------------------------------------------------

    def _collect(self, completions: list[Completion]) -> None:
        self._end([self._finished(c) for c in completions if c.id in self.in_flight])

    def _end(self, items: list[Finished]) -> None:
        self.unwritten += items
        self.batch_log.ended(items)
        self.jobs_done += len(items)
        self.metrics.canceled(sum(item.canceled for item in items))

    def _publish_text(self) -> None:
        """The text streaming jobs generated this turn (at most one engine step), before any of
        their results: one round trip, none while no job in hand streams."""
        deltas = [(self.in_flight[d.id].claimed.id, d) for d in self.engine.stream_deltas() if d.id in self.in_flight]
        if deltas:
            token_streams.publish(self.connection, deltas)

    def _flush(self) -> None:
        """Write what ended; on an outage the items stay for the next try."""
        if self.unwritten:
            self.bridge.finish(self.unwritten)
            self.unwritten = []

    def _finished(self, completion: Completion) -> Finished:
        flight = self.in_flight.pop(completion.id)
        if completion.error == ABORTED:  # only `_cancel` aborts: RQ reads the job canceled already
            return Finished(flight.claimed, canceled=True)
        if not completion.ok:
            self.metrics.failed("input" if completion.input_error else "transient")
            return Finished(flight.claimed, error=completion.error, retry=not completion.input_error)
        timings = job_timings(completion, flight.payload.submitted_at, flight.claimed.started_at, flight.preprocess_s)
        result = caption_result(
            flight.claimed.id,
            completion,
            timings,
            worker=self.name,
            engine=self.engine.name,
            model=self.config.model_id,
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
        self.state = WorkerState.STOPPING
