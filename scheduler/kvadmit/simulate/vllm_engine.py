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

Prompt tokens: with prefix caching and a workload with prefix-block ids, equal
ids give equal token blocks (a pseudo-random sequence seeded by the id), so
vLLM's content hashes hit exactly where the native engine's id hashes do; the
fake model emits the same id-derived tokens as outputs where the ids cover the
output (agent sessions: the next turn's prompt repeats this turn's output).
Everything else is pseudo-random per request (seeded, deterministic).

kvadmit's refusals (at arrival, and waiting requests shed) come from the scheduler's
`VllmAdmission.take_refused()` (kvadmit.vllm.admission), not from the outputs.

kvadmit's core runs on the virtual clock: the scheduler's injectable clock
(`scheduler.kvadmit.clock`) reads the arrival time (at add_request) or the step's start (at
schedule), as the native engine passes them. vLLM's own timestamps stay real.

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

import functools
import heapq
import json
import math
import pathlib
import time

import numpy as np

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, RawRun
from kvadmit.simulate.record import IN_ENGINE, RunRecord
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import Workload

_SALT_BLOCK = 0x6B766164          # seeds for a prefix id's tokens: [id, _SALT_BLOCK]
_SALT_REQUEST = 0x72657175        # seeds for a request's own tokens: [seed, index, _SALT_REQUEST]
PROGRESS_EVERY = 200


class _VirtualTime:
    """The clock kvadmit's vLLM scheduler runs on during a replay (its
    `kvadmit.clock`), so the core's time (drain rate, max_queue_delay_s, step
    times, sessions) is the virtual one: arrivals at their arrival time,
    admissions at the step's start, as the native engine passes them."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def now(self) -> float:
        return self.t


@functools.lru_cache(maxsize=8192)
def _block_tokens(block_id: int, n: int, vocab: int) -> tuple[int, ...]:
    """The tokens of prefix-block id `block_id`: n values in [3, vocab) (never EOS=2)."""
    seed = [abs(block_id), 1 if block_id < 0 else 0, _SALT_BLOCK]
    return tuple(np.random.default_rng(seed).integers(3, vocab, n).tolist())


def _own_tokens(seed: int, index: int, n: int, vocab: int) -> list[int]:
    if n <= 0:
        return []
    return np.random.default_rng([seed, index, _SALT_REQUEST]).integers(3, vocab, n).tolist()


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
    default of requiring its whole input to fit)."""
    return VllmReplay(workload, config, shape, step, model_dir, sample_interval_s, seed,
                      engine_args).run(progress)


class VllmReplay:
    """One replay (see the module's docstring): the engine, the arrival queue,
    the virtual clock and the run's record."""

    def __init__(self, workload: Workload, config: AdmissionConfig | None, shape: EngineShape,
                 step: StepTimeModel, model_dir: str, sample_interval_s: float | None = None,
                 seed: int = 0, engine_args: dict | None = None):
        import kvadmit.vllm.scheduler as kvadmit_sched
        from kvadmit.vllm.inprocess import InProcessEngine

        if workload.hash_block_tokens and workload.hash_block_tokens % shape.block_size:
            raise ValueError(f"workload {workload.name}: prefix-id blocks of {workload.hash_block_tokens} "
                             f"tokens are not a multiple of block_size={shape.block_size}")
        if sample_interval_s is None:
            sample_interval_s = max(workload.open_loop_span_s() / 500.0, 0.05)
        if not (math.isfinite(sample_interval_s) and sample_interval_s > 0):
            raise ValueError(f"sample_interval_s={sample_interval_s}: must be > 0")
        if not shape.chunked_prefill and shape.max_num_batched_tokens < shape.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={shape.max_num_batched_tokens}: without chunked prefill it "
                f"must be >= max_model_len={shape.max_model_len}, or a long prompt never fits a step")
        n = len(workload)
        is_open = [workload.is_open(i) for i in range(n)]
        if n and not any(is_open):
            raise ValueError("no request has a fixed arrival time (every one has a parent)")
        self.children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(workload.parent or ()):
            if p >= i:
                raise ValueError(f"parent[{i}]={p}: must be -1 or an earlier request's index")
            if p >= 0:
                self.children[p].append(i)
        self.workload, self.shape, self.step_time, self.seed = workload, shape, step, seed
        self.kvadmit = config is not None
        self.delay = workload.delay_s or [0.0] * n
        self.prio = workload.priority or [0] * n

        engine_args = dict(engine_args or {})
        engine_args.setdefault("scheduler_reserve_full_isl", shape.reserve_full_input)
        engine_args.setdefault("watermark", shape.watermark)
        if shape.max_num_active_seqs:
            engine_args.setdefault("max_num_active_seqs", shape.max_num_active_seqs)
        model_len = _model_max_len(model_dir)
        if model_len is not None and shape.max_model_len > model_len:
            # The model is never run: let the context exceed what its config declares.
            engine_args["hf_overrides"] = {**engine_args.get("hf_overrides", {}),
                                           "max_position_embeddings": shape.max_model_len}
        self.eng = InProcessEngine(
            model_dir, scheduler_cls=kvadmit_sched.KvadmitScheduler if config is not None else None,
            num_blocks=shape.num_blocks + 1, block_size=shape.block_size,
            max_model_len=shape.max_model_len, max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            additional_config={"kvadmit": config.to_dict()} if config is not None else None,
            enable_prefix_caching=shape.prefix_caching, enable_chunked_prefill=shape.chunked_prefill,
            engine_args=engine_args)
        self.sched = self.eng.scheduler
        self.pool = self.sched.kv_cache_manager.block_pool
        self.nb = self.pool.num_gpu_blocks - 1            # usable blocks (== shape.num_blocks)
        self.vocab = self.eng.vllm_config.model_config.get_vocab_size()
        self.hbt = (workload.hash_block_tokens
                    if shape.prefix_caching and workload.hash_ids is not None else 0)
        # kvadmit on the scheduler (kvadmit.vllm.admission.VllmAdmission; None: vLLM's own)
        self.kvadmit_state = getattr(self.sched, "kvadmit", None)
        if self.kvadmit_state is not None:
            self.kvadmit_state.watch_refusals()
        self.heap = [(workload.arrival_s[i], i) for i in range(n) if is_open[i]]
        heapq.heapify(self.heap)
        self.clock = self.heap[0][0] if self.heap else 0.0
        self.rec = RunRecord(n, self.nb, self.clock, sample_interval_s)
        self.vt = _VirtualTime(self.clock)
        if config is not None:
            self.kvadmit_state.clock = self.vt.now

    # -- requests ---------------------------------------------------------------
    def tokens_of(self, i: int) -> tuple[list[int], list[int] | None]:
        """Request i's prompt tokens, and the output tokens the fake model emits
        (None: pseudo-random) where its prefix-block ids cover the output."""
        w = self.workload
        p, o = w.prompt_tokens[i], w.output_tokens[i]
        if not self.hbt:
            return _own_tokens(self.seed, i, p, self.vocab), None
        ids = w.hash_ids_of(i)
        hashed = w.hashed_tokens[i] if w.hashed_tokens is not None else p
        h = max(0, min(hashed, len(ids) * self.hbt, p + o))
        toks: list[int] = []
        for k in range(-(-h // self.hbt)):
            toks.extend(_block_tokens(int(ids[k]), self.hbt, self.vocab))
        del toks[h:]
        toks.extend(_own_tokens(self.seed, i, p + o - h, self.vocab))
        return toks[:p], toks[p:]

    def reject(self, i: int, why: str, t: float) -> None:
        self.rec.reject(i, why, t)
        self.release_children(i, t)

    def release_children(self, i: int, t: float) -> None:
        for c in self.children[i]:
            heapq.heappush(self.heap, (t + self.delay[c], c))

    def take_rejections(self) -> None:
        """kvadmit's refusals (and priority sheds) since the last look, at the clock."""
        for rid, reason in self.kvadmit_state.take_refused():
            i = int(rid)
            if self.rec.state[i] == IN_ENGINE:
                self.reject(i, reason, self.clock)

    def arrivals(self) -> None:
        """Every request due by the clock reaches vLLM (or its front end's refusal)."""
        w = self.workload
        while self.heap and self.heap[0][0] <= self.clock:
            t, i = heapq.heappop(self.heap)
            self.rec.arrive(i, t)
            p, m = w.prompt_tokens[i], w.max_tokens[i]
            if p + m > self.shape.max_model_len:
                # vLLM's front end refuses it (HTTP 400) before it reaches the engine.
                self.reject(i, "context_length", t)
                continue
            prompt_ids, out_ids = self.tokens_of(i)
            self.vt.t = t
            fields = {}
            if w.ttft_slo_s is not None:
                fields["ttft_slo_s"] = w.ttft_slo_s[i]
            if w.tpot_slo_s is not None:
                fields["tpot_slo_s"] = w.tpot_slo_s[i]
            if w.session is not None:
                fields["session"] = w.session[i]
            self.eng.add(prompt_ids, m, priority=self.prio[i], request_id=str(i),
                         output_tokens=w.output_tokens[i], output_token_ids=out_ids,
                         extra_args={"kvadmit": fields} if fields else None)
            if self.kvadmit_state is not None:
                self.take_rejections()

    # -- steps ------------------------------------------------------------------
    def step(self) -> tuple[bool, bool]:
        """One schedule() + update_from_output(): (time passed, anything happened)."""
        rec, eng = self.rec, self.eng
        self.vt.t = self.clock
        out = eng.step()
        if self.kvadmit_state is not None:
            self.take_rejections()
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
                rec.compute(i, computed[rid] - k, computed[rid], self.workload.prompt_tokens[i])
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

    def wait(self) -> str:
        """Nothing ran: moves the clock to what comes next ("moved"), or says that
        everything is done ("done") or that requests are left with nothing to run."""
        # Only requests held outside a full agent window wait: sleep until an idle
        # session leaves it (the adapter expires it at the next schedule()).
        state = self.kvadmit_state
        expiry = state.core.next_session_expiry() if state is not None else math.inf
        if expiry < math.inf and (not self.heap or expiry <= self.heap[0][0]) and expiry > self.clock:
            self.clock = expiry
            return "moved"
        if self.heap:
            self.clock = max(self.clock, self.heap[0][0])
            return "moved"
        return "stalled" if self.sched.has_requests() else "done"

    def run(self, progress=None) -> RawRun:
        rec, n = self.rec, len(self.workload)
        wall0 = time.perf_counter()
        since = stalls = 0
        while True:
            self.arrivals()
            if self.sched.has_requests():
                ran, moved = self.step()
                if ran:
                    stalls = 0
                    since += 1
                    if progress is not None and since >= PROGRESS_EVERY:
                        since = 0
                        progress(rec.done, n)
                    continue
                if moved:
                    stalls = 0
                    continue              # preemptions or flushed outputs, no time passed
            waited = self.wait()
            if waited == "done":
                break
            if waited == "stalled":
                stalls += 1
                if stalls > 3:
                    running, waiting = self.sched.get_request_counts()
                    raise RuntimeError(
                        f"vLLM engine stuck at t={self.clock:.3f}s: {waiting} waiting, {running} "
                        f"running, {self.pool.get_num_free_blocks()} free blocks, nothing schedulable")
        wall = time.perf_counter() - wall0
        if progress is not None:
            progress(rec.done, n)
        return self.result(wall)

    def result(self, wall: float) -> RawRun:
        rec = self.rec
        missing = rec.unfinished()
        if missing:
            raise AssertionError(f"{len(missing)} requests neither finished nor rejected "
                                 f"(first: {missing[:5]})")
        free = self.pool.get_num_free_blocks()
        if free != self.nb or self.sched.get_num_unfinished_requests():
            raise AssertionError(f"leak: {self.nb - free} of {self.nb} blocks still used at idle, "
                                 f"{self.sched.get_num_unfinished_requests()} requests still in vLLM")
        totals = rec.totals(
            self.clock, free,
            # vLLM's own prefix-cache counters (queries and hits at each admission,
            # including re-admissions after preemption): 0 without prefix caching.
            prefix_hit_tokens=self.eng.log.prefix_hit_tokens,
            prefix_query_tokens=self.eng.log.prefix_query_tokens,
            held_for_blocks=0)          # vLLM does not say why a waiting request did not start
        extra = {"scheduler": "kvadmit" if self.kvadmit else "vllm",
                 "vllm_num_gpu_blocks": self.pool.num_gpu_blocks}
        if self.kvadmit:
            extra["core"] = self.kvadmit_state.core.stats()
        return RawRun("vllm", rec.per_request(), totals, rec.timeline, wall, extra=extra)
