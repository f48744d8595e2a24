"""The simulator's second engine: vLLM's real V1 scheduler on a virtual clock.

`run_vllm` replays a `Workload` through vLLM's own scheduler (config None) or
kvadmit's (`KvadmitScheduler`), in-process, with fake model outputs
(`kvadmit.vllm.inprocess.InProcessEngine`): every scheduling, chunking,
allocation, prefix-cache and preemption decision is vLLM's code; only the
forward pass is replaced by the step-time model. It returns a `RawRun` with the
same fields as `run_native`.

The loop, as the native engine's (native/kvadmit/_native_engine.pyx):
- the clock starts at the first open-loop arrival; before each step every
  request due by the clock arrives (a session's next turn its delay after the
  previous one finished or was refused); with nothing to run the clock jumps to
  the next arrival;
- a step is one `schedule()` + `update_from_output()`; it takes
  T = step.step_s(tokens, context) with tokens the step's scheduled tokens and
  context the sum over its scheduled requests of num_computed_tokens right after
  `schedule()` (vLLM has already added the step's tokens); tokens it produces
  are stamped at clock + T;
- requests stop at their real output length (EOS from the fake model) under
  their max_tokens.

The KV pool: vLLM keeps one block (the null block) out of use, so vLLM is given
shape.num_blocks + 1 blocks: requests (and kvadmit's core, which sees
num_gpu_blocks - 1) get exactly shape.num_blocks, as in the native engine.

Prompt tokens (equal prefix-block ids become equal token blocks, so vLLM's prefix
cache hits where the native engine's id hashes do) and the table of the requests
added: `kvadmit.simulate.vllm_requests`.

kvadmit's refusals (at arrival, and waiting requests shed) come from the scheduler's
`VllmAdmission.take_refused()` (kvadmit.vllm.admission), not from the outputs.

kvadmit's core runs on the virtual clock, given to the scheduler's adapter once
(`VllmAdmission.set_clock`): it reads the arrival time (at add_request) or the
step's start (at schedule), as the native engine passes them. vLLM's own
timestamps stay real.

`VllmEngine` is the engine on the stepped-engine contract
(`kvadmit.simulate.stepped.SteppedEngine`: start / add_requests / advance / drain,
as the native engine's); `run_vllm` (`VllmReplay`) is the one-engine driver over
it, and a fleet (`kvadmit.simulate.fleet.run_fleet`, ``make_engine``) may drive
several.

Where it differs from the native engine (by design, this is vLLM's behaviour):
- (none in admission: `EngineShape.reserve_full_input` sets vLLM's
  `scheduler_reserve_full_isl` and the native engine's rule alike; both run the
  same schedule on the tested workloads, tests/simulate/test_vllm_engine.py);
- prompt + max_tokens over max_model_len is refused by vLLM's front end at the
  arrival time (the native engine: at the next step boundary);
- prefix_query_tokens / prefix_hit_tokens are vLLM's prefix-cache counters,
  0 without prefix caching (the native engine counts queries regardless);
- held_for_blocks is 0 (vLLM does not say why a waiting request did not start).
"""
from __future__ import annotations

import heapq
import json
import math
import pathlib
import time

from kvadmit._native import Requests
from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, RawRun
from kvadmit.simulate.record import DONE, IN_ENGINE, REJECTED, RunRecord, Totals
from kvadmit.simulate.stepped import first_arrival, replay
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.vllm_requests import RequestTable
from kvadmit.simulate.workload import Workload

PROGRESS_EVERY = 200


class _VirtualTime:
    """The clock kvadmit's vLLM scheduler runs on during a replay (given to
    `VllmAdmission.set_clock`), so the core's time (drain rate, max_queue_delay_s, step
    times, sessions) is the virtual one: arrivals at their arrival time,
    admissions at the step's start, as the native engine passes them."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def now(self) -> float:
        return self.t


def _model_max_len(model_dir: str) -> int | None:
    try:
        cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("max_position_embeddings")
    return int(v) if isinstance(v, int) else None


def run_vllm(workload: Workload, config: AdmissionConfig | None, shape: EngineShape,
             step: StepTimeModel, model_dir: str, sample_interval_s: float | None = None,
             progress=None, seed: int = 0, engine_args: dict | None = None) -> RawRun:
    """Replays `workload` through vLLM's V1 scheduler (``config`` None: vLLM's own;
    else kvadmit's with that configuration) on a virtual clock. ``model_dir`` is a
    model vLLM can configure (the tiny one, `kvadmit.vllm.tiny_model`); it is never run.
    ``progress(done, total)`` is called every 200 steps and at the end. ``seed`` picks
    the pseudo-random prompt tokens; ``engine_args`` are further vLLM `EngineArgs`
    fields (e.g. ``{"scheduler_reserve_full_isl": False}``: admit a waiting request
    when its first chunk fits, as the native engine does, instead of vLLM 0.32's
    default of requiring its whole input to fit).

    A driver over the stepped-engine contract (`kvadmit.simulate.stepped`): every
    request added up front, then start at the first arrival and drain."""
    replay = VllmReplay(workload, config, shape, step, model_dir, sample_interval_s, seed,
                        engine_args)
    return replay.run(progress)


class VllmReplay:
    """One engine replaying one workload (see the module's docstring): a `VllmEngine`
    with the workload's requests added, started at the first arrival and drained."""

    def __init__(self, workload: Workload, config: AdmissionConfig | None, shape: EngineShape,
                 step: StepTimeModel, model_dir: str, sample_interval_s: float | None = None,
                 seed: int = 0, engine_args: dict | None = None):
        workload.check_block_size(shape.block_size)
        if config is not None:
            workload = workload.screened(config)
        if sample_interval_s is None:
            sample_interval_s = workload.sample_interval_s()
        n = len(workload)
        self.t0 = first_arrival(workload.arrival_s, workload.parent) if n else 0.0
        self.workload = workload
        self.engine = VllmEngine(config, shape, step, model_dir, sample_interval_s, seed,
                                 engine_args, hash_block_tokens=workload.hash_block_tokens)
        self.engine.add_requests(workload.requests(hash_ids=shape.prefix_caching))

    def run(self, progress=None) -> RawRun:
        wall0 = time.perf_counter()
        replay(self.engine, self.t0, progress)
        return self.engine.raw_run(time.perf_counter() - wall0)


class VllmEngine:
    """vLLM's V1 scheduler in-process on a virtual clock, stepped by a driver
    (`kvadmit.simulate.stepped.SteppedEngine`): `start`, `add_requests` and
    `advance` in turns, `drain`; `results`, `totals`, `timeline`. ``config`` None:
    vLLM's own scheduler, else kvadmit's. ``hash_block_tokens``: tokens a prefix-block
    id stands for (requests added with hash ids, under prefix caching)."""

    clock: float = 0.0      # the engine's time: the end of its last step, or where it idled to

    def __init__(self, config: AdmissionConfig | None, shape: EngineShape, step: StepTimeModel,
                 model_dir: str, sample_interval_s: float, seed: int = 0,
                 engine_args: dict | None = None, hash_block_tokens: int = 0):
        if not (math.isfinite(sample_interval_s) and sample_interval_s > 0):
            raise ValueError(f"sample_interval_s={sample_interval_s}: must be > 0")
        if not shape.chunked_prefill and shape.max_num_batched_tokens < shape.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={shape.max_num_batched_tokens}: without chunked prefill it "
                f"must be >= max_model_len={shape.max_model_len}, or a long prompt never fits a step")
        if hash_block_tokens < 0 or (hash_block_tokens and hash_block_tokens % shape.block_size):
            raise ValueError(f"hash_block_tokens={hash_block_tokens}: must be 0 or a multiple of "
                             f"block_size={shape.block_size}")
        self.shape, self.step_time = shape, step
        self.kvadmit = config is not None
        self.eng = _in_process_engine(config, shape, model_dir, engine_args)
        self.sched = self.eng.scheduler
        self.pool = self.sched.kv_cache_manager.block_pool
        self.nb = self.pool.num_gpu_blocks - 1            # usable blocks (== shape.num_blocks)
        self.req = RequestTable(seed, hash_block_tokens if shape.prefix_caching else 0,
                                self.eng.vllm_config.model_config.get_vocab_size())
        self.children: list[list[int]] = []
        self.heap: list[tuple[float, int]] = []
        self.clock = 0.0
        self.rec = RunRecord(0, self.nb, 0.0, sample_interval_s)
        self.rejections: list[tuple[int, str, float, float | None]] = []
        self._started = False
        self._horizon = -math.inf
        # kvadmit on the scheduler (kvadmit.vllm.admission.VllmAdmission; None: vLLM's own),
        # on the virtual clock
        self.vt = _VirtualTime(0.0)
        self.kvadmit_state = getattr(self.sched, "kvadmit", None)
        if self.kvadmit_state is not None:
            self.kvadmit_state.watch_refusals()
            self.kvadmit_state.set_clock(self.vt.now)

    # -- the stepped-engine contract ---------------------------------------------
    def add_requests(self, requests: Requests) -> None:
        """Appends `kvadmit.Requests` (checked when built), as `NativeEngine.add_requests`:
        here only what depends on the engine's state (a refused batch adds nothing)."""
        base = len(self.req)
        requests.check_append(base, self.req.last_open,
                              self._horizon if self._started else -math.inf,
                              lambda p: self.rec.finish[p] if self.rec.state[p] in (DONE, REJECTED)
                              else None)
        rows = [requests.row(i) for i in range(len(requests))]
        for r in rows:
            self.req.append(r)
        self.children.extend([] for _ in rows)
        self.rec.extend(len(rows))
        for i in range(base, base + len(rows)):
            p = self.req.parent[i]
            if p >= 0:
                self.children[p].append(i)
            else:
                heapq.heappush(self.heap, (self.req.arrival[i], i))

    def start(self, t0: float) -> None:
        if self._started:
            raise RuntimeError("start twice")
        if not math.isfinite(t0):
            raise ValueError(f"t0={t0}: must be finite")
        if self.heap and self.heap[0][0] < t0:
            raise ValueError(f"t0={t0}: after the first arrival {self.heap[0][0]}")
        self._started = True
        self.clock = self.vt.t = self._horizon = t0
        self.rec.start(t0)

    def advance(self, until: float) -> bool:
        if not self._started:
            raise RuntimeError("advance before start")
        if not until >= self._horizon:
            raise ValueError(f"until={until}: before the last advance's until {self._horizon}")
        idle = self._loop(until)
        self._horizon = until
        return idle

    def drain(self, progress=None) -> None:
        if not self._started:
            raise RuntimeError("drain before start")
        self._loop(math.inf, progress)
        self._horizon = max(self._horizon, self.clock)
        self._check_idle()

    def take_rejections(self) -> list:
        out, self.rejections = self.rejections, []
        return out

    def signals(self) -> dict:
        """As `NativeEngine.signals`; vLLM's own scheduler has no forecast: its
        headroom is the free blocks, its pressure the blocks in use, no queue delay."""
        running, waiting = self.sched.get_request_counts()
        free = self.pool.get_num_free_blocks()
        used = self.nb - free
        state = self.kvadmit_state
        sig = (state.port.router_signals() if state is not None else
               {"kv_headroom_blocks": free, "admission_pressure": used / self.nb,
                "predicted_queue_delay_s": 0.0})
        sig.update(num_requests_waiting=waiting, num_requests_running=running,
                   kv_cache_usage_perc=used / self.nb, active_blocks=used, num_blocks=self.nb,
                   finished=self.rec.finished, rejected=self.rec.rejected,
                   preemptions=self.rec.preemptions,
                   prefix_hit_tokens=self.eng.log.prefix_hit_tokens,
                   prefix_query_tokens=self.eng.log.prefix_query_tokens, clock_s=self.clock)
        return sig

    def results(self) -> dict:
        return self.rec.per_request()

    def totals(self) -> dict:
        return self.rec.totals(
            self.clock, self.pool.get_num_free_blocks(),
            # vLLM's own prefix-cache counters (queries and hits at each admission,
            # including re-admissions after preemption): 0 without prefix caching.
            prefix_hit_tokens=self.eng.log.prefix_hit_tokens,
            prefix_query_tokens=self.eng.log.prefix_query_tokens,
            held_for_blocks=0).as_dict()    # vLLM does not say why a waiting request did not start

    def timeline(self) -> dict:
        return self.rec.timeline

    def raw_run(self, wall: float) -> RawRun:
        """The drained run as the simulator's `RawRun`."""
        extra = {"scheduler": "kvadmit" if self.kvadmit else "vllm",
                 "vllm_num_gpu_blocks": self.pool.num_gpu_blocks}
        if self.kvadmit:
            extra["core"] = self.kvadmit_state.port.stats()
            extra["flows"] = self.kvadmit_state.port.flow_stats()
        return RawRun("vllm", self.results(), Totals.from_engine(self.totals()), self.timeline(),
                      wall, extra=extra)

    # -- requests ---------------------------------------------------------------
    def reject(self, i: int, why: str, t: float, retry_after_s: float | None = None) -> None:
        self.rec.reject(i, why, t)
        self.rejections.append((i, why, t, retry_after_s))
        self.release_children(i, t)

    def release_children(self, i: int, t: float) -> None:
        for c in self.children[i]:
            heapq.heappush(self.heap, (t + self.req.delay[c], c))

    def take_refused(self) -> None:
        """kvadmit's refusals (and priority sheds) since the last look, at the clock."""
        for rid, refusal in self.kvadmit_state.take_refusals():
            i = int(rid)
            if self.rec.state[i] == IN_ENGINE:
                self.reject(i, refusal.reason, self.clock, refusal.retry_after_s)

    def arrivals(self) -> None:
        """Every request due by the clock reaches vLLM (or its front end's refusal)."""
        q = self.req
        while self.heap and self.heap[0][0] <= self.clock:
            t, i = heapq.heappop(self.heap)
            self.rec.arrive(i, t)
            p, m = q.prompt[i], q.maxtok[i]
            if p + m > self.shape.max_model_len:
                # vLLM's front end refuses it (HTTP 400) before it reaches the engine.
                self.reject(i, "context_length", t)
                continue
            prompt_ids, out_ids = q.tokens_of(i)
            self.vt.t = t
            fields = q.fields(i)
            self.eng.add(prompt_ids, m, priority=q.prio[i], request_id=str(i),
                         output_tokens=q.out[i], output_token_ids=out_ids,
                         extra_args={"kvadmit": fields} if fields else None)
            if self.kvadmit_state is not None:
                self.take_refused()

    # -- steps ------------------------------------------------------------------
    def step(self) -> tuple[bool, bool]:
        """One schedule() + update_from_output(): (time passed, anything happened)."""
        rec, eng = self.rec, self.eng
        self.vt.t = self.clock
        out = eng.step()
        if self.kvadmit_state is not None:
            self.take_refused()
        tokens = out.total_num_scheduled_tokens
        preempted = out.preempted_req_ids or ()
        for rid in preempted:
            rec.preempt(int(rid))
        t_end = self.clock
        if tokens > 0:
            computed = eng.last_computed
            dt = self.step_time.step_s(tokens, sum(computed.values()))
            t_end = self.clock + dt
            rec.step(tokens, dt, self.nb - eng.last_free_blocks)
            for rid, k in out.num_scheduled_tokens.items():
                i = int(rid)
                rec.compute(i, computed[rid] - k, computed[rid], self.req.prompt[i])
        for o in eng.last_outputs:
            i = int(o.request_id)
            if rec.state[i] != IN_ENGINE:
                continue          # refused by kvadmit: already recorded
            if o.new_token_ids:
                rec.emit(i, len(o.new_token_ids), t_end)
            if o.finish_reason is not None:
                rec.complete(i, t_end)
                self.release_children(i, t_end)
        if tokens > 0:
            self.clock = t_end
            if rec.due_sample(self.clock):
                running, waiting = self.sched.get_request_counts()
                rec.sample(self.clock, self.nb - self.pool.get_num_free_blocks(), running, waiting)
        return tokens > 0, bool(tokens or preempted or eng.last_outputs)

    def wait(self, until: float = math.inf) -> str:
        """Nothing ran: moves the clock to what comes next ("moved"; to `until` if that
        comes first: "until"), or says that everything is done ("done") or that
        requests are left with nothing to run ("stalled")."""
        # Only requests held outside a full agent window wait: sleep until the window
        # changes (the adapter's next schedule() steps the core at that time).
        state = self.kvadmit_state
        held = state is not None and self.sched.get_request_counts()[1] > 0
        expiry = state.port.next_window_change() if held else math.inf
        if expiry < math.inf and (not self.heap or expiry <= self.heap[0][0]) and expiry > self.clock:
            nxt = expiry
        elif self.heap:
            nxt = max(self.clock, self.heap[0][0])
        else:
            return "stalled" if self.sched.has_requests() else "done"
        if nxt >= until:
            self.clock = max(self.clock, until)
            return "until"
        self.clock = nxt
        return "moved"

    def _loop(self, until: float, progress=None) -> bool:
        """Steps until the clock reaches `until` (no step starts at or after it) or,
        with nothing left to arrive, everything is done: True then."""
        since = stalls = 0
        while self.clock < until:
            self.arrivals()
            if self.sched.has_requests():
                ran, moved = self.step()
                if ran:
                    stalls = 0
                    since += 1
                    if progress is not None and since >= PROGRESS_EVERY:
                        since = 0
                        progress(self.rec.done, len(self.req))
                    continue
                if moved:
                    stalls = 0
                    continue              # preemptions or flushed outputs, no time passed
            waited = self.wait(until)
            if waited == "done":
                if until < math.inf:
                    self.clock = max(self.clock, until)
                if progress is not None:
                    progress(self.rec.done, len(self.req))
                return True
            if waited == "stalled":
                stalls += 1
                if stalls > 3:
                    running, waiting = self.sched.get_request_counts()
                    raise RuntimeError(
                        f"vLLM engine stuck at t={self.clock:.3f}s: {waiting} waiting, {running} "
                        f"running, {self.pool.get_num_free_blocks()} free blocks, nothing schedulable")
        return False

    def _check_idle(self) -> None:
        rec = self.rec
        missing = rec.unfinished()
        if missing:
            raise AssertionError(f"{len(missing)} requests neither finished nor rejected "
                                 f"(first: {missing[:5]})")
        free = self.pool.get_num_free_blocks()
        if free != self.nb or self.sched.get_num_unfinished_requests():
            raise AssertionError(f"leak: {self.nb - free} of {self.nb} blocks still used at idle, "
                                 f"{self.sched.get_num_unfinished_requests()} requests still in vLLM")


def _in_process_engine(config: AdmissionConfig | None, shape: EngineShape, model_dir: str,
                       engine_args: dict | None):
    """vLLM's scheduler (kvadmit's with ``config``) of this shape, without a model."""
    import kvadmit.vllm.scheduler as kvadmit_sched
    from kvadmit.vllm.inprocess import InProcessEngine

    engine_args = dict(engine_args or {})
    policy = engine_args.pop("scheduling_policy", shape.scheduling_policy)   # InProcessEngine's own argument
    engine_args.setdefault("scheduler_reserve_full_isl", shape.reserve_full_input)
    engine_args.setdefault("watermark", shape.watermark)
    if shape.max_num_active_seqs:
        engine_args.setdefault("max_num_active_seqs", shape.max_num_active_seqs)
    model_len = _model_max_len(model_dir)
    if model_len is not None and shape.max_model_len > model_len:
        # The model is never run: let the context exceed what its config declares.
        engine_args["hf_overrides"] = {**engine_args.get("hf_overrides", {}),
                                       "max_position_embeddings": shape.max_model_len}
    return InProcessEngine(
        model_dir, scheduler_cls=kvadmit_sched.KvadmitScheduler if config is not None else None,
        num_blocks=shape.num_blocks + 1, block_size=shape.block_size,
        max_model_len=shape.max_model_len, max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        additional_config={"kvadmit": config.to_dict()} if config is not None else None,
        enable_prefix_caching=shape.prefix_caching, enable_chunked_prefill=shape.chunked_prefill,
        scheduling_policy=policy, engine_args=engine_args)

