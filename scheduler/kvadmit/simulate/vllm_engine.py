"""The simulator's second engine: vLLM's real V1 scheduler on a virtual clock.

`run_vllm` replays a `Workload` through vLLM's own scheduler (config None) or
kvadmit's (`KvadmitScheduler`), in-process, with fake model outputs
(`kvadmit.vllm.inprocess.InProcessEngine`): every scheduling, chunking,
allocation, prefix-cache and preemption decision is vLLM's code; only the
forward pass is replaced by the step-time model. It returns a `RawRun` with the
same fields as `run_native`.

The loop, as the native engine's (native/sim.pxi):
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

kvadmit's core runs on the virtual clock: the scheduler's injectable clock
(`kvadmit_clock`) reads the arrival time (at add_request) or the step's start (at
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
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import Workload

_SALT_BLOCK = 0x6B766164          # seeds for a prefix id's tokens: [id, _SALT_BLOCK]
_SALT_REQUEST = 0x72657175        # seeds for a request's own tokens: [seed, index, _SALT_REQUEST]
PROGRESS_EVERY = 200

_PENDING, _IN_ENGINE, _DONE, _REJECTED = 0, 1, 2, 3


class _VirtualTime:
    """The clock kvadmit's vLLM scheduler runs on during a replay (its
    `kvadmit_clock`), so the core's time (drain rate, max_queue_delay_s, step
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
    parent = workload.parent
    is_open = [workload.is_open(i) for i in range(n)]
    if n and not any(is_open):
        raise ValueError("no request has a fixed arrival time (every one has a parent)")
    children: list[list[int]] = [[] for _ in range(n)]
    if parent is not None:
        for i, p in enumerate(parent):
            if p >= i:
                raise ValueError(f"parent[{i}]={p}: must be -1 or an earlier request's index")
            if p >= 0:
                children[p].append(i)
    delay = workload.delay_s or [0.0] * n
    prio = workload.priority or [0] * n

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
    eng = InProcessEngine(
        model_dir, scheduler_cls=kvadmit_sched.KvadmitScheduler if config is not None else None,
        num_blocks=shape.num_blocks + 1, block_size=shape.block_size,
        max_model_len=shape.max_model_len, max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        additional_config={"kvadmit": config.to_dict()} if config is not None else None,
        enable_prefix_caching=shape.prefix_caching, enable_chunked_prefill=shape.chunked_prefill,
        engine_args=engine_args)
    sched = eng.scheduler
    pool = sched.kv_cache_manager.block_pool
    nb = pool.num_gpu_blocks - 1            # usable blocks (== shape.num_blocks)
    vocab = eng.vllm_config.model_config.get_vocab_size()
    hbt = workload.hash_block_tokens if shape.prefix_caching and workload.hash_ids is not None else 0
    pending_rejections = getattr(sched, "_kvadmit_rejections", None)   # kvadmit's refusals at add

    # per request
    arrival = [-1.0] * n
    t_first = [-1.0] * n
    t_done = [-1.0] * n
    gen = [0] * n
    npre = [0] * n
    maxcomp = [0] * n
    reason: list[str | None] = [None] * n
    state = [_PENDING] * n
    # totals
    steps = preemptions = recomputed = out_tokens = prefill_tokens = batch_tokens = 0
    peak_used = 0
    kv_block_s = busy_s = 0.0
    n_done = n_rejected = 0
    tl = {"t": [], "used_blocks": [], "running": [], "waiting": [], "preemptions": []}

    heap: list[tuple[float, int]] = [(workload.arrival_s[i], i) for i in range(n) if is_open[i]]
    heapq.heapify(heap)
    clock = t0 = heap[0][0] if heap else 0.0
    next_sample = t0

    def release_children(i: int, t: float) -> None:
        for c in children[i]:
            heapq.heappush(heap, (t + delay[c], c))

    def reject(i: int, why: str, t: float) -> None:
        nonlocal n_rejected
        state[i] = _REJECTED
        reason[i] = why
        t_done[i] = t
        n_rejected += 1
        release_children(i, t)

    def tokens_of(i: int) -> tuple[list[int], list[int] | None]:
        p, o = workload.prompt_tokens[i], workload.output_tokens[i]
        if not hbt:
            return _own_tokens(seed, i, p, vocab), None
        ids = workload.hash_ids_of(i)
        hashed = workload.hashed_tokens[i] if workload.hashed_tokens is not None else p
        h = max(0, min(hashed, len(ids) * hbt, p + o))
        toks: list[int] = []
        for k in range(-(-h // hbt)):
            toks.extend(_block_tokens(int(ids[k]), hbt, vocab))
        del toks[h:]
        toks.extend(_own_tokens(seed, i, p + o - h, vocab))
        return toks[:p], toks[p:]

    rej_seen = 0

    def take_rejections() -> None:
        """kvadmit's refusals (and priority sheds) at add_request, at the arrival clock
        (the next update_from_output hands them out and clears the list)."""
        nonlocal rej_seen
        fresh = pending_rejections[rej_seen:]
        rej_seen = len(pending_rejections)
        for _, o in fresh:
            i = int(o.request_id)
            if state[i] == _IN_ENGINE:
                reject(i, str(o.stop_reason)[len(kvadmit_sched.STOP_REASON_PREFIX):], clock)

    def arrivals() -> None:
        while heap and heap[0][0] <= clock:
            t, i = heapq.heappop(heap)
            arrival[i] = t
            p, m = workload.prompt_tokens[i], workload.max_tokens[i]
            if p + m > shape.max_model_len:
                # vLLM's front end refuses it (HTTP 400) before it reaches the engine.
                reject(i, "context_length", t)
                continue
            prompt_ids, out_ids = tokens_of(i)
            state[i] = _IN_ENGINE
            vt.t = t
            fields = {}
            if workload.ttft_slo_s is not None:
                fields["ttft_slo_s"] = workload.ttft_slo_s[i]
            if workload.tpot_slo_s is not None:
                fields["tpot_slo_s"] = workload.tpot_slo_s[i]
            if workload.session is not None:
                fields["session"] = workload.session[i]
            eng.add(prompt_ids, m, priority=prio[i], request_id=str(i),
                    output_tokens=workload.output_tokens[i], output_token_ids=out_ids,
                    extra_args={"kvadmit": fields} if fields else None)
            if pending_rejections:
                take_rejections()

    wall0 = time.perf_counter()
    since = 0
    stalls = 0
    vt = _VirtualTime(clock)
    if config is not None:
        sched.kvadmit_clock = vt.now
    while True:
        arrivals()
        if sched.has_requests():
            vt.t = clock
            out = eng.step()
            rej_seen = 0
            tokens = out.total_num_scheduled_tokens
            preempted = out.preempted_req_ids or ()
            for rid in preempted:
                npre[int(rid)] += 1
            preemptions += len(preempted)
            t_end = clock
            if tokens > 0:
                computed = eng.last_computed
                dt = step.step_s(tokens, sum(computed.values()))
                t_end = clock + dt
                used = nb - eng.last_free_blocks
                if used > peak_used:
                    peak_used = used
                kv_block_s += used * dt
                busy_s += dt
                batch_tokens += tokens
                for rid, k in out.num_scheduled_tokens.items():
                    i = int(rid)
                    c1 = computed[rid]
                    c0 = c1 - k
                    if c0 < maxcomp[i]:
                        recomputed += min(c1, maxcomp[i]) - c0
                    if c1 > maxcomp[i]:
                        maxcomp[i] = c1
                    p = workload.prompt_tokens[i]
                    if c0 < p:
                        prefill_tokens += min(c1, p) - c0
            for o in eng.last_outputs:
                i = int(o.request_id)
                if state[i] != _IN_ENGINE:
                    continue          # refused at add_request: already recorded
                if o.new_token_ids:
                    gen[i] += len(o.new_token_ids)
                    out_tokens += len(o.new_token_ids)
                    if t_first[i] < 0:
                        t_first[i] = t_end
                if o.finish_reason is not None:
                    sr = o.stop_reason
                    if isinstance(sr, str) and sr.startswith(kvadmit_sched.STOP_REASON_PREFIX):
                        reject(i, sr[len(kvadmit_sched.STOP_REASON_PREFIX):], clock)
                    else:
                        state[i] = _DONE
                        t_done[i] = t_end
                        n_done += 1
                        release_children(i, t_end)
            if tokens > 0:
                clock = t_end
                steps += 1
                stalls = 0
                if clock >= next_sample:
                    used_now = nb - pool.get_num_free_blocks()
                    running, waiting = sched.get_request_counts()
                    while clock >= next_sample:
                        tl["t"].append(next_sample)
                        tl["used_blocks"].append(used_now)
                        tl["running"].append(running)
                        tl["waiting"].append(waiting)
                        tl["preemptions"].append(preemptions)
                        next_sample += sample_interval_s
                since += 1
                if progress is not None and since >= PROGRESS_EVERY:
                    since = 0
                    progress(n_done + n_rejected, n)
                continue
            if preempted or eng.last_outputs:
                stalls = 0
                continue              # preemptions or flushed outputs, no time passed
        # Only requests held outside a full agent window wait: sleep until an idle
        # session leaves it (the adapter expires it at the next schedule()).
        core = getattr(sched, "kvadmit_core", None)
        expiry = core.next_session_expiry() if core is not None else math.inf
        if expiry < math.inf and (not heap or expiry <= heap[0][0]) and expiry > clock:
            clock = expiry
            continue
        if heap:
            clock = max(clock, heap[0][0])
            continue
        if not sched.has_requests():
            break
        stalls += 1
        if stalls > 3:
            running, waiting = sched.get_request_counts()
            raise RuntimeError(
                f"vLLM engine stuck at t={clock:.3f}s: {waiting} waiting, {running} running, "
                f"{pool.get_num_free_blocks()} free blocks, nothing schedulable")
    wall = time.perf_counter() - wall0
    if progress is not None:
        progress(n_done + n_rejected, n)

    missing = [i for i in range(n) if state[i] not in (_DONE, _REJECTED)]
    if missing:
        raise AssertionError(f"{len(missing)} requests neither finished nor rejected "
                             f"(first: {missing[:5]})")
    free = pool.get_num_free_blocks()
    if free != nb or sched.get_num_unfinished_requests():
        raise AssertionError(f"leak: {nb - free} of {nb} blocks still used at idle, "
                             f"{sched.get_num_unfinished_requests()} requests still in vLLM")

    span = clock - t0
    totals = {
        "steps": steps, "preemptions": preemptions, "recomputed_tokens": recomputed,
        "output_tokens": out_tokens, "prefill_tokens": prefill_tokens, "batch_tokens": batch_tokens,
        # vLLM's own prefix-cache counters (queries and hits at each admission,
        # including re-admissions after preemption): 0 without prefix caching.
        "prefix_hit_tokens": eng.log.prefix_hit_tokens,
        "prefix_query_tokens": eng.log.prefix_query_tokens,
        "held_for_blocks": 0,          # vLLM does not say why a waiting request did not start
        "makespan_s": span, "busy_s": busy_s,
        "kv_util_mean": kv_block_s / (span * nb) if span > 0 else 0.0,
        "kv_util_peak": peak_used / nb,
        "finished": n_done, "rejected": n_rejected,
        "free_blocks_at_end": free,
    }
    per_request = {
        "arrival_s": arrival, "first_token_s": t_first, "finish_s": t_done,
        "output_tokens": gen, "preemptions": npre, "rejected": reason,
    }
    extra = {"scheduler": "kvadmit" if config is not None else "vllm",
             "vllm_num_gpu_blocks": pool.num_gpu_blocks}
    if config is not None:
        extra["core"] = sched.kvadmit_core.stats()
    return RawRun("vllm", per_request, totals, tl, wall, extra=extra)
