"""A fleet: N engines behind a router, on one virtual clock.

Each instance is a stepped engine (`kvadmit.simulate.stepped.SteppedEngine`: by
default the compiled `NativeEngine`; `make_engine` may give vLLM's scheduler,
`kvadmit.simulate.vllm_engine.VllmEngine`), its own policy and config, driven only
through that contract. The driver's time advances in sync ticks (a quarter of the scrape
interval): at each tick every engine runs the steps that start before it, and
the driver collects what the engines answered (finished, refused with a reason
and a Retry-After); at every scrape (each fourth tick) the router gets each
instance's `signals()`, which it then uses, stale, until the next scrape.
Between ticks requests arrive in time order and the router places each at
once; an engine sees it at its next step boundary, as `run` would.

Clients: a request refused with a Retry-After (by an engine, or by the router)
comes back that many seconds later (an engine's refusal reaches the client at
the next tick at the latest), to another instance where one is left, at most
`max_retries` times; a refusal without a hint (Dynamo's 529) is retried after
`retry_backoff_s`; one that can never succeed (context length) is final. The
client's TTFT counts from its first attempt.

Work: O(events) in the driver: arrivals and retries (each O(N) in the router)
and ticks (O(N) each); the engines' steps run natively.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from typing import Callable, Optional

from kvadmit._native import Requests
from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, native_engine
from kvadmit.simulate.metrics import Slo, summarize
from kvadmit.simulate.policies import PolicySpec
from kvadmit.simulate.record import Totals
from kvadmit.simulate.routers import ROUTERS, Refusal, Request, make_router
from kvadmit.simulate.stepped import SteppedEngine
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import Workload

SYNC_PER_SCRAPE = 4
MAX_INSTANCES = 1024
MAX_RETRIES = 100


@dataclass(frozen=True)
class FleetSetup:
    """The fleet: one policy per instance, the router and the clients' retry rule."""
    policies: tuple[PolicySpec, ...]
    router: str
    scrape_interval_s: float = 0.2
    max_retries: int = 3
    retry_backoff_s: float = 1.0
    busy_threshold: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        n = len(self.policies)
        if not 1 <= n <= MAX_INSTANCES:
            raise ValueError(f"--instances {n}: must be in [1, {MAX_INSTANCES}]")
        if self.router not in ROUTERS:
            raise ValueError(f"--router {self.router!r}: must be one of {', '.join(ROUTERS)}")
        if not (math.isfinite(self.scrape_interval_s) and 0.001 <= self.scrape_interval_s <= 60):
            raise ValueError(f"--scrape-interval {self.scrape_interval_s}: must be in [0.001, 60] seconds")
        if not 0 <= self.max_retries <= MAX_RETRIES:
            raise ValueError(f"--max-retries {self.max_retries}: must be in [0, {MAX_RETRIES}]")
        if not (math.isfinite(self.retry_backoff_s) and self.retry_backoff_s > 0):
            raise ValueError(f"--retry-backoff {self.retry_backoff_s}: must be a number of seconds > 0")
        if not 0 < self.busy_threshold <= 1:
            raise ValueError(f"--busy-threshold {self.busy_threshold}: must be in (0, 1] "
                             f"(a share of the KV pool)")

    @property
    def label(self) -> str:
        names = [p.name for p in self.policies]
        return names[0] if len(set(names)) == 1 else "+".join(names)


@dataclass
class FleetRun:
    per_request: dict                 # client view, in workload order (as RawRun's)
    totals: Totals                    # summed over instances (makespan, finished and
                                      # rejected: the fleet's clients'; an engine's
                                      # refusals of retried requests are in counts)
    instances: list[dict]             # per instance: totals and its share of the work
    counts: dict                      # retries, router refusals, engine refusals, gave up
    placed: list                      # per request: the instance of its last attempt (-1: router)
    attempts: list                    # per request: attempts made
    wall_s: float
    timeline: dict = field(default_factory=dict)


class _Outbox:
    """Requests routed to one engine since the last tick, added in one call."""

    def __init__(self, prefix: bool):
        self.prefix = prefix
        self.clear()

    def clear(self):
        self.arr, self.prompt, self.out, self.mx, self.ttft, self.tpot = [], [], [], [], [], []
        self.prio, self.prompt_hash = [], []
        self.off, self.ids, self.hashed = [0], [], []

    def push(self, i: int, t: float, prompt: int, out: int, mx: int, prio: int, ttft: float,
             tpot: float, hashed: int, hash_ids) -> None:
        """Request i's attempt at t (its prompt_hash is i + 1: a retry repeats its
        prompt, another client's prompt differs)."""
        self.prompt_hash.append(i + 1)
        self.arr.append(t)
        self.prompt.append(prompt)
        self.out.append(out)
        self.mx.append(mx)
        self.prio.append(prio)
        self.ttft.append(ttft)
        self.tpot.append(tpot)
        self.hashed.append(hashed)
        if self.prefix:
            self.ids.extend(hash_ids)
            self.off.append(len(self.ids))

    def flush(self, eng: SteppedEngine) -> None:
        if not self.arr:
            return
        eng.add_requests(Requests(
            self.arr, self.prompt, self.out, self.mx, priority=self.prio, ttft_slo_s=self.ttft,
            tpot_slo_s=self.tpot, prompt_hash=self.prompt_hash, hashed_tokens=self.hashed,
            hash_offsets=self.off if self.prefix else None,
            hash_ids=self.ids if self.prefix else None))
        self.clear()


def check_open_loop(workload: Workload) -> None:
    """A fleet routes open-loop requests in arrival order, as they come."""
    if workload.parent is not None and any(p >= 0 for p in workload.parent):
        raise ValueError(f"workload {workload.name}: a fleet replays open-loop requests only "
                         f"(session turns that wait for their previous turn are not routed yet)")
    arr = workload.arrival_s
    for i, t in enumerate(arr):
        if not math.isfinite(t) or (i > 0 and t < arr[i - 1]):
            raise ValueError(f"workload {workload.name}: arrival_s[{i}]={t}: arrivals must be "
                             f"finite and not decrease (a fleet routes them in order)")


def _last_scrape_tick(t0: float, tick: float, t: float, k_from: int) -> int:
    """The last scrape tick (a multiple of SYNC_PER_SCRAPE) at or before t, as a tick
    count from t0; k_from or below if none lies after k_from."""
    k = int((t - t0) / tick)
    k -= k % SYNC_PER_SCRAPE
    while k > k_from and t0 + k * tick > t:     # rounding
        k -= SYNC_PER_SCRAPE
    return k


# An instance's engine: (its policy, its shape) -> a stepped engine with no requests yet.
EngineFactory = Callable[[PolicySpec, EngineShape], SteppedEngine]


def run_fleet(workload: Workload, setup: FleetSetup, shape: EngineShape, step: StepTimeModel,
              base: AdmissionConfig, slo: Slo, progress=None,
              make_engine: Optional[EngineFactory] = None) -> FleetRun:
    """Replays an open-loop workload through the fleet. ``make_engine(policy, shape)``
    builds each instance (default: the native engine model, `native_engine`)."""
    check_open_loop(workload)
    t_wall = time.perf_counter()
    if make_engine is None:
        def make_engine(p: PolicySpec, s: EngineShape) -> SteppedEngine:
            return native_engine(workload, p.config(base), s, step)
    fleet = _Fleet(workload, setup, shape, make_engine, slo)
    fleet.run(progress)
    return _assemble(workload, fleet.engines, fleet.owner, fleet.final_reason, fleet.counts,
                     fleet.attempts, fleet.placed, fleet.t0, time.perf_counter() - t_wall)


class _Fleet:
    """One fleet run's state: the engines, the router, and each request's attempts.
    `run` is the event loop: arrivals and retries in time order, routed at once,
    between sync ticks at which every engine runs to the tick and answers."""

    def __init__(self, workload: Workload, setup: FleetSetup, shape: EngineShape,
                 make_engine: EngineFactory, slo: Slo):
        n_inst, n = len(setup.policies), len(workload)
        self.workload, self.setup, self.n = workload, setup, n
        self.engines: list[SteppedEngine] = [make_engine(p, p.shape(shape)) for p in setup.policies]
        self.oracle = [p.oracle for p in setup.policies]
        prefix = [p.shape(shape).prefix_caching and workload.hash_ids is not None
                  for p in setup.policies]
        self.router = make_router(setup.router, n_inst, shape.block_size,
                                  [p.shape(shape).num_blocks for p in setup.policies],
                                  seed=setup.seed, busy_threshold=setup.busy_threshold,
                                  scrape_interval_s=setup.scrape_interval_s)
        self.ttft = workload.ttft_slo_s or [slo.ttft_s] * n
        self.tpot = workload.tpot_slo_s or [slo.tpot_s] * n
        self.hashed = workload.hashed_tokens
        self.attempts = [0] * n
        self.placed = [-1] * n                     # the instance of the last attempt (-1: router)
        self.exclude: list = [None] * n
        self.final_reason: list = [None] * n
        self.owner = [[] for _ in range(n_inst)]   # engine-local index -> request
        self.outbox = [_Outbox(prefix[e]) for e in range(n_inst)]
        self.retries: list = []                    # heap of (time, seq, request)
        self.counts = {"retries": 0, "router_refusals": 0, "engine_refusals": 0, "gave_up": 0}
        self.finished_seen = [0] * n_inst
        self.req_view = Request(0, 0, 0.0, 0.0)
        self.seq = 0
        self.t0 = workload.arrival_s[0] if n else 0.0
        self.tick = setup.scrape_interval_s / SYNC_PER_SCRAPE

    def run(self, progress) -> None:
        """Every request routed (and retried) in time order, the engines synced at each
        tick, until nothing is left anywhere; then the engines drain."""
        workload, n, t0, tick = self.workload, self.n, self.t0, self.tick
        for eng in self.engines:
            eng.start(t0)
        k_sync = 0                                # the next tick is t0 + k_sync * tick
        nxt = 0                                   # the next first arrival
        last_report = 0.0
        idle = False
        while True:
            t_arr = workload.arrival_s[nxt] if nxt < n else math.inf
            t_ret = self.retries[0][0] if self.retries else math.inf
            t_ev = min(t_arr, t_ret)
            t_sync = t0 + k_sync * tick
            if t_sync <= t_ev:
                if t_ev == math.inf and idle and not any(ob.arr for ob in self.outbox):
                    break
                if idle and t_ev < math.inf and t_ev > t_sync + tick:
                    # nothing runs anywhere until t_ev: skip the empty ticks
                    k_sync = max(k_sync, _last_scrape_tick(t0, tick, t_ev, k_sync))
                    t_sync = t0 + k_sync * tick
                idle = self.sync(t_sync, k_sync % SYNC_PER_SCRAPE == 0)
                k_sync += 1
                if progress is not None and time.perf_counter() - last_report > 0.5:
                    last_report = time.perf_counter()
                    progress(nxt, n)
                continue
            idle = False
            if t_arr <= t_ret:
                self.route(nxt, t_arr)
                nxt += 1
            else:
                t, _, i = heapq.heappop(self.retries)
                self.route(i, t)
        for eng in self.engines:
            eng.drain()
        if progress is not None:
            progress(n, n)

    def refused(self, i: int, reason: str, retry_at: float | None, at_instance: int | None) -> None:
        """The client of request i was refused: it comes back at `retry_at` (None:
        never, the refusal is final) unless its retries are spent."""
        if retry_at is None or self.attempts[i] > self.setup.max_retries:
            self.final_reason[i] = reason
            if retry_at is not None:
                self.counts["gave_up"] += 1
            return
        if at_instance is not None:
            if self.exclude[i] is None:
                self.exclude[i] = set()
            self.exclude[i].add(at_instance)
        self.counts["retries"] += 1
        self.seq += 1
        heapq.heappush(self.retries, (retry_at, self.seq, i))

    def sync(self, t: float, scrape: bool) -> bool:
        """Every engine runs to t; their answers are collected. True if all are idle."""
        all_idle = True
        sigs = []
        for e, eng in enumerate(self.engines):
            self.outbox[e].flush(eng)
            all_idle &= eng.advance(t)
            for local, reason, t_rej, ra in eng.take_rejections():
                i = self.owner[e][local]
                self.counts["engine_refusals"] += 1
                self.router.answered(e, 1)
                # the client hears of it at this tick at the latest
                self.refused(i, reason, None if ra is None else max(t_rej + ra, t), e)
            sig = eng.signals()
            if sig["finished"] != self.finished_seen[e]:
                self.router.answered(e, sig["finished"] - self.finished_seen[e])
                self.finished_seen[e] = sig["finished"]
            sigs.append(sig)
        if scrape:
            self.router.observe(sigs)
        return all_idle

    def route(self, i: int, t: float) -> None:
        """Request i's attempt at t: the router places it (in its engine's outbox until
        the next tick) or refuses it (the client retries after the hint or the backoff)."""
        workload, req_view = self.workload, self.req_view
        self.attempts[i] += 1
        req_view.prompt_tokens = workload.prompt_tokens[i]
        req_view.max_tokens = workload.max_tokens[i]
        req_view.ttft_slo_s = self.ttft[i]
        req_view.tpot_slo_s = self.tpot[i]
        req_view.hash_ids = workload.hash_ids_of(i) if workload.hash_ids is not None else None
        choice = self.router.choose(req_view, t, self.exclude[i] or ())
        if isinstance(choice, Refusal):
            self.placed[i] = -1
            self.counts["router_refusals"] += 1
            # a router's refusal is an overload answer: without a hint, the client backs off
            ra = (choice.retry_after_s if choice.retry_after_s is not None
                  else self.setup.retry_backoff_s)
            self.refused(i, choice.reason, t + ra, None)
            return
        e = choice
        self.placed[i] = e
        self.router.sent(e, req_view)
        prompt = workload.prompt_tokens[i]
        self.outbox[e].push(i, t, prompt, workload.output_tokens[i],
                            workload.output_tokens[i] if self.oracle[e] else workload.max_tokens[i],
                            workload.priority[i] if workload.priority is not None else 0,
                            self.ttft[i], self.tpot[i],
                            self.hashed[i] if self.hashed is not None else prompt,
                            req_view.hash_ids)
        self.owner[e].append(i)


def _assemble(workload: Workload, engines, owner, final_reason, counts, attempts, placed,
              t0: float, wall_s: float) -> FleetRun:
    n = len(workload)
    first, finish = [-1.0] * n, [-1.0] * n
    out_tok, preempt = [0] * n, [0] * n
    rejected = list(final_reason)
    instances, tot = [], {}
    for e, eng in enumerate(engines):
        res, t = eng.results(), eng.totals()
        served = 0
        for local, i in enumerate(owner[e]):
            if res["rejected"][local] is None:
                first[i], finish[i] = res["first_token_s"][local], res["finish_s"][local]
                out_tok[i], preempt[i] = res["output_tokens"][local], res["preemptions"][local]
                served += 1
        instances.append({"routed": len(owner[e]), "served": served, **t})
        for k, v in t.items():
            if isinstance(v, (int, float)):
                tot[k] = tot.get(k, 0) + v
    for i in range(n):
        if rejected[i] is None and first[i] < 0:
            raise AssertionError(f"request {i}: neither served nor refused")
    end = max([f for f in finish if f >= 0], default=t0)
    tot["makespan_s"] = end - t0
    # per request, as every engine's Totals (finished + rejected == requests): an
    # engine's refusal of a request served after a retry is no rejection of it
    tot["finished"] = sum(1 for i in range(n) if rejected[i] is None)
    tot["rejected"] = n - tot["finished"]
    tot["kv_util_mean"] = sum(x["kv_util_mean"] for x in instances) / len(instances)
    tot["kv_util_peak"] = max(x["kv_util_peak"] for x in instances)
    tot = Totals.from_engine(tot)
    per_request = {"arrival_s": list(workload.arrival_s), "first_token_s": first, "finish_s": finish,
                   "output_tokens": out_tok, "preemptions": preempt, "rejected": rejected}
    return FleetRun(per_request, tot, instances, counts, list(placed), list(attempts), wall_s)


def summarize_fleet(run: FleetRun, workload: Workload, slo: Slo) -> dict:
    """`summarize`'s numbers for the fleet, plus retries, router refusals and the
    load imbalance (the busiest instance's output tokens over the mean)."""
    s = summarize(run.per_request, run.totals, slo, workload.ttft_slo_s, workload.tpot_slo_s)
    toks = [x["output_tokens"] for x in run.instances]
    mean = sum(toks) / len(toks)
    s.update(run.counts)
    s["imbalance"] = max(toks) / mean if mean > 0 else 1.0
    s["per_instance"] = [{k: x[k] for k in ("routed", "served", "output_tokens", "preemptions",
                                            "kv_util_mean", "busy_s")} for x in run.instances]
    return s
