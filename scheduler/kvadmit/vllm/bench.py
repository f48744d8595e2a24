"""Real vLLM engine, same workload, vLLM's scheduler against each kvadmit policy.

Runs `vllm.LLM.generate` once per configuration in this process (one engine
at a time) on a tiny random-weight Llama built locally, and reports per
configuration: preemptions, recomputed tokens, engine steps, wall time, output
tokens/s, TTFT and TPOT p50/p99, rejections, and whether every request
produced exactly its expected tokens.

Real output lengths shorter than `max_tokens` are made real: each request
carries its trace length, and the `StopAtLength` logits processor makes the
model emit EOS at exactly that position (finish_reason "stop"), so the
scheduler sees a `max_tokens` cap it cannot trust, as in production.

    python -m kvadmit.vllm.bench --workload azure --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import random
import sys
import time
from dataclasses import dataclass

import torch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from kvadmit._native import POLICIES
from kvadmit.simulate.scorecard import WATERMARKS
from kvadmit.vllm.engine_log import engine_log, say
from kvadmit.vllm.scheduler import KvadmitAsyncScheduler, KvadmitScheduler
from kvadmit.vllm.tiny_model import DEFAULT_DIR, EOS_TOKEN_ID

# The Azure 2023 conversation trace bundled in the package (kvadmit.traces.BUNDLED).
DEFAULT_TRACE = "azure2023_conv"
COUNTS_ENV = "KVADMIT_BENCH_COUNTS"
EXPECT_ENV = "KVADMIT_BENCH_EXPECT"
STEP_TIMES_ENV = "KVADMIT_BENCH_STEP_TIMES"


class _CountsScheduledTokens:
    """Bench-only scheduler additions:

    - adds up the tokens each step schedules (prompts, recomputation after
      preemption, decodes) and writes the total to $KVADMIT_BENCH_COUNTS, since
      vLLM's own metrics do not count recomputed tokens;
    - holds the first step until $KVADMIT_BENCH_EXPECT requests have arrived, so
      the whole workload is queued before anything runs (a burst) and two runs of
      the same workload schedule identically, whatever the timing of arrivals.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bench_expect = int(os.environ.get(EXPECT_ENV, "0"))
        self._bench_seen = 0
        if self._bench_expect:
            self.set_pause_state(PauseState.PAUSED_ALL)

    def add_request(self, request):
        out = super().add_request(request)
        self._bench_seen += 1
        if self._bench_expect and self._bench_seen == self._bench_expect:
            self.set_pause_state(PauseState.UNPAUSED)
        return out

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        self._bench_tokens = getattr(self, "_bench_tokens", 0) + out.total_num_scheduled_tokens
        path = os.environ.get(COUNTS_ENV)
        if path and out.total_num_scheduled_tokens:
            state = getattr(self, "kvadmit", None)       # None: vLLM's own scheduler
            paused = state.core.paused if state is not None else 0
            pathlib.Path(path).write_text(f"{self._bench_tokens} {paused}")
        return out


class CountingVllmScheduler(_CountsScheduledTokens, VllmScheduler):
    """vLLM's own Scheduler, counting scheduled tokens."""


class CountingVllmAsyncScheduler(_CountsScheduledTokens, VllmAsyncScheduler):
    """vLLM's own AsyncScheduler, counting scheduled tokens."""


class CountingKvadmitScheduler(_CountsScheduledTokens, KvadmitScheduler):
    """kvadmit's scheduler, counting scheduled tokens."""


class CountingKvadmitAsyncScheduler(_CountsScheduledTokens, KvadmitAsyncScheduler):
    """kvadmit's async scheduler, counting scheduled tokens."""


class _TimesSteps:
    """Bench-only: times the real engine's steps from inside the scheduler
    (bench/fit_cpu_step_time.py).

    At the start of each schedule() call, appends one line for the PREVIOUS
    step (if it scheduled any tokens) to $KVADMIT_BENCH_STEP_TIMES:
    `interval_s tokens context requests schedule_s start_s`, where interval_s
    is the wall time from the previous schedule() call's start to this one's
    (that step's scheduling, model forward and update_from_output, run serially
    without async scheduling), tokens is its total scheduled tokens, context
    the sum over its scheduled requests of num_computed_tokens after the step
    (the KV length attention reads), requests how many it scheduled,
    schedule_s how long its schedule() took and start_s its start on
    time.perf_counter()'s clock (CLOCK_MONOTONIC on Linux: comparable with
    the parent process's).
    """

    def schedule(self, *args, **kwargs):
        now = time.perf_counter()
        prev = getattr(self, "_bench_prev", None)
        if prev is not None:
            if not hasattr(self, "_bench_times"):
                path = os.environ.get(STEP_TIMES_ENV)
                self._bench_times = open(path, "a", buffering=1) if path else None
            if self._bench_times is not None:
                self._bench_times.write(f"{now - prev[0]:.9f} {prev[1]} {prev[2]} {prev[3]} "
                                        f"{prev[4]:.9f} {prev[0]:.9f}\n")
        out = super().schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            context = sum(self.requests[r].num_computed_tokens for r in out.num_scheduled_tokens)
            self._bench_prev = (now, out.total_num_scheduled_tokens, context,
                                len(out.num_scheduled_tokens), time.perf_counter() - now)
        else:
            self._bench_prev = None
        return out


class TimingVllmScheduler(_TimesSteps, _CountsScheduledTokens, VllmScheduler):
    """vLLM's own (sync) Scheduler, counting scheduled tokens and timing steps."""


class CountingScheduler:
    """Picks the counting flavour: vLLM's own or kvadmit's (when additional_config
    has a "kvadmit" key), sync or async."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config") or args[0]
        ours = "kvadmit" in (vllm_config.additional_config or {})
        if vllm_config.scheduler_config.async_scheduling:
            impl = CountingKvadmitAsyncScheduler if ours else CountingVllmAsyncScheduler
        else:
            impl = CountingKvadmitScheduler if ours else CountingVllmScheduler
        return impl(*args, **kwargs)

STOP_AT_KEY = "kvadmit_stop_at"


class StopAtLength(LogitsProcessor):
    """Forces EOS as output token number `extra_args["kvadmit_stop_at"]`.

    Requests without the key are untouched. Pair with `min_tokens = stop_at - 1`
    so the random model cannot stop earlier by chance."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[int, list[int]]] = {}   # batch row -> (stop_at, output ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            stop_at = (params.extra_args or {}).get(STOP_AT_KEY) if params else None
            if stop_at:
                self.rows[index] = (int(stop_at), output_ids)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None and direction.name == "SWAP":
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (stop_at, out) in self.rows.items():
            if len(out) + 1 >= stop_at and row < logits.shape[0]:
                logits[row].fill_(-float("inf"))
                logits[row, EOS_TOKEN_ID] = 0.0
        return logits


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    output_tokens: int      # the real length: tokens it produces (== max_tokens: no early stop)


def synthetic_workload(n: int, max_model_len: int, cap: int, seed: int = 0,
                       stop_early: bool = True) -> list[BenchRequest]:
    """Prompts of 16-128 random tokens; lognormal real lengths (median 32) under a `cap`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(16, 128)
        m = min(cap, max_model_len - p)
        real = max(2, min(m, int(rng.lognormvariate(math.log(32), 0.9)))) if stop_early else m
        out.append(BenchRequest(tuple(rng.randrange(3, 1000) for _ in range(p)), m, real))
    return out


def azure_workload(path: str, n: int, max_model_len: int, cap: int, seed: int = 0,
                   trace_context: int = 8192) -> list[BenchRequest]:
    """The first `n` Azure conversation requests, lengths scaled by max_model_len / trace_context
    (the tiny model's context against an 8k-context production model); the cap is scaled too."""
    from kvadmit.traces import load_trace

    scale = max_model_len / trace_context
    rng = random.Random(seed)
    out = []
    for r in load_trace(path, limit=n):
        p = max(1, min(max_model_len - 2, round(r.prompt_tokens * scale)))
        m = max(2, min(round(cap * scale), max_model_len - p))
        real = max(2, min(m, round(r.output_tokens * scale)))
        out.append(BenchRequest(tuple(rng.randrange(3, 1000) for _ in range(p)), m, real))
    return out


def as_burst(requests: list[BenchRequest], name: str = "bench"):
    """The bench's requests as a simulator Workload, all queued at once (as the bench
    runs them), for the native engine model."""
    from kvadmit.simulate import Workload
    return Workload(name=name, arrival_s=[0.0] * len(requests),
                    prompt_tokens=[len(r.prompt_token_ids) for r in requests],
                    output_tokens=[r.output_tokens for r in requests],
                    max_tokens=[r.max_tokens for r in requests])


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _metric(metrics, name):
    for m in metrics:
        if m.name == name:
            return m
    return None


# ---------------------------------------------------------------------------
# The engine and the configurations

@dataclass(frozen=True)
class BenchEngine:
    """The engine every configuration runs on (vLLM's argument names)."""
    num_blocks: int = 33            # vLLM's num_gpu_blocks_override: one of them is its null block
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 2048   # None: vLLM's default (4096 on its CPU build)
    dtype: str = "float32"

    def sim_shape(self):
        """The simulator's EngineShape of this engine (it counts usable blocks only)."""
        from kvadmit.simulate import EngineShape
        if self.max_num_batched_tokens is None:
            raise ValueError("the simulator needs the engine's max_num_batched_tokens")
        return EngineShape(num_blocks=self.num_blocks - 1, block_size=self.block_size,
                           max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                           max_num_batched_tokens=self.max_num_batched_tokens)


CONFIGS = {"vllm-default": None, **{p: {"policy": p} for p in POLICIES},
           # adaptive with every knob for throughput: a fixed optimistic quantile (no
           # raising), unlimited bypass, and pausing instead of preempting on a shortfall.
           "adaptive+pause": {"policy": "adaptive", "shortfall": "pause", "adaptive_quantile": 0.4,
                              "adaptive_max_quantile": 0.4, "adaptive_min_samples": 1,
                              "head_of_line": "bypass", "max_bypass": 1000, "bypass_lookahead": 256},
           # the empty config: what `--scheduler-cls kvadmit.vllm.Scheduler` alone gives
           "kvadmit-default": {}}
CONFIG_DOCS = {"vllm-default": "vLLM 0.32's own scheduler, no admission flags",
               **{p: f"kvadmit, policy {p!r}" for p in POLICIES},
               "adaptive+pause": "kvadmit adaptive at a fixed 0.4 quantile, bypass, pause on a shortfall",
               "kvadmit-default": "kvadmit with the empty config {}: AdmissionConfig()'s defaults (policy auto)"}

# vLLM's --max-num-queued-reqs: a bench-only name (the simulator models the engine
# core, where this cap does not act). vLLM checks it in AsyncLLM.check_admission (its
# API server) only; LLM.generate, which this bench drives, never does.
QUEUED_KNOB = "vllm-queued"
QUEUED_DOC = ("vLLM with --max-num-queued-reqs {}: checked only by vLLM's API server "
              "(AsyncLLM), never by offline LLM.generate, so it runs as vllm-default here")
# vLLM engine arguments that act outside the engine core (the simulator has no field for them)
FRONT_END_ONLY = ("max_num_queued_reqs",)


@dataclass(frozen=True)
class BenchConfig:
    """One row: which scheduler runs, with which of vLLM's own engine arguments."""
    label: str
    kvadmit: dict | None        # additional_config["kvadmit"]; None: vLLM's own scheduler
    engine_args: dict           # vLLM EngineArgs fields: its own knobs (watermark, ...)
    doc: str

    def sim(self, shape):
        """(AdmissionConfig, EngineShape) for the simulator's native engine: vLLM's rule
        (overcommit, LIFO victim) with its knobs in the shape, or kvadmit's config."""
        from kvadmit.config import AdmissionConfig
        from kvadmit.vllm.settings import VllmSettings
        # vLLM-only settings (native_allocator) change no decision: the simulator has none.
        config = (AdmissionConfig(policy="overcommit", victim="lifo") if self.kvadmit is None
                  else AdmissionConfig.from_dict(VllmSettings.split(self.kvadmit)[1]))
        knobs = {k: v for k, v in self.engine_args.items() if k not in FRONT_END_ONLY}
        return config, dataclasses.replace(shape, **knobs)


def _vllm_only_keys(value: str) -> dict:
    """The vLLM-only keys of a NAME=JSON config's JSON, checked ({} if it is not an object)."""
    from kvadmit.vllm.settings import VLLM_ONLY_KEYS, VllmSettings
    try:
        settings = json.loads(value)
    except json.JSONDecodeError:
        return {}                        # parse_policy names the JSON error
    if not isinstance(settings, dict):
        return {}
    VllmSettings.split(settings)         # a bad vLLM-only value is an error now
    return {k: v for k, v in settings.items() if k in VLLM_ONLY_KEYS}


def parse_config(text: str) -> BenchConfig:
    """A bench name (CONFIGS), `vllm-watermark=F`, `vllm-active=N`, `vllm-queued=N`,
    a simulator baseline, or NAME=JSON with kvadmit's AdmissionConfig keys and the
    vLLM-only ones (kvadmit.vllm.settings)."""
    from kvadmit.simulate.policies import parse_policy
    if text in CONFIGS:
        return BenchConfig(text, CONFIGS[text], {}, CONFIG_DOCS[text])
    name, sep, value = text.partition("=")
    if sep and name == QUEUED_KNOB:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"config {text}: max_num_queued_reqs must be an integer >= 1")
        return BenchConfig(text, None, {"max_num_queued_reqs": n}, QUEUED_DOC.format(n))
    # NAME=JSON may hold vLLM-only keys (native_allocator): the simulator's parser,
    # which checks the rest, does not take them.
    vllm_only = _vllm_only_keys(value) if sep else {}
    if vllm_only:
        text = f"{name}={json.dumps({k: v for k, v in json.loads(value).items() if k not in vllm_only})}"
    # vllm-watermark=F and vllm-active=N: the simulator's names, checks and engine
    # fields (EngineShape's knob fields carry vLLM's EngineArgs names).
    spec = parse_policy(text)
    if spec.oracle:
        raise ValueError(f"config {text}: the oracle needs true lengths as caps: use --caps real "
                         f"with peak instead")
    return BenchConfig(spec.name, None if spec.vllm_own else {**spec.settings, **vllm_only},
                       dict(spec.engine), f"custom: {value}" if vllm_only else spec.doc)


def split_configs(args: list[str]) -> list[str]:
    """`--configs` values: names separated by spaces or commas; a comma inside a NAME=JSON
    object (braces, brackets, strings) belongs to the JSON."""
    out = []
    for arg in args:
        depth, in_str, escaped, cur = 0, False, False, []
        for ch in arg:
            if in_str:
                escaped = not escaped and ch == "\\"
                in_str = escaped or ch != '"'
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
            elif ch == "," and depth == 0:
                out.append("".join(cur).strip())
                cur = []
                continue
            cur.append(ch)
        out.append("".join(cur).strip())
    return [c for c in out if c]


def run_one(label: str, model_dir: str, workload: list[BenchRequest], engine: BenchEngine,
            kvadmit: dict | None, stop_early: bool, engine_args: dict | None = None) -> dict:
    """One engine, one generate call; returns the row of numbers for `label`.
    ``engine_args``: further vLLM engine arguments (its own knobs)."""
    from vllm import LLM, SamplingParams

    import tempfile
    counts = pathlib.Path(tempfile.mkstemp(prefix="kvadmit-bench-")[1])
    os.environ[COUNTS_ENV] = str(counts)
    os.environ[EXPECT_ENV] = str(len(workload))
    kwargs = dict(scheduler_cls="kvadmit.vllm.bench.CountingScheduler", **(engine_args or {}))
    if engine.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if kvadmit is not None:
        kwargs["additional_config"] = {"kvadmit": kvadmit}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=engine.dtype,
              block_size=engine.block_size, num_gpu_blocks_override=engine.num_blocks,
              max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs,
              enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, disable_log_stats=False, enable_prefix_caching=False,
              logits_processors=[StopAtLength] if stop_early else None, **kwargs)
    params = []
    for r in workload:
        extra = {STOP_AT_KEY: r.output_tokens} if stop_early and r.output_tokens < r.max_tokens else None
        params.append(SamplingParams(
            max_tokens=r.max_tokens, temperature=0.0, ignore_eos=not stop_early,
            min_tokens=(r.output_tokens - 1) if extra else 0, extra_args=extra))
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    metrics = llm.get_metrics()
    preempt = _metric(metrics, "vllm:num_preemptions")
    iters = _metric(metrics, "vllm:iteration_tokens_total")
    tokens, ttft, tpot, rejected, wrong = [], [], [], {}, 0
    for r, o in zip(workload, outs):
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        if isinstance(c.stop_reason, str) and c.stop_reason.startswith("kvadmit:"):
            rejected[c.stop_reason] = rejected.get(c.stop_reason, 0) + 1
            continue
        if len(c.token_ids) != r.output_tokens:
            wrong += 1
        m = o.metrics
        if m is not None and m.first_token_latency:
            ttft.append(m.first_token_latency)
            if m.num_generation_tokens > 1:
                tpot.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
    # Shut the engine down first: its last step's count must be on disk before we read it.
    llm.llm_engine.engine_core.shutdown()
    del llm
    import gc
    gc.collect()
    computed, paused = (int(x) for x in (counts.read_text() or "0 0").split())
    counts.unlink()
    # Every request computes its prompt once and feeds back all but its last token.
    needed = sum(len(r.prompt_token_ids) + max(len(t) - 1, 0) for r, t in zip(workload, tokens))
    row = {
        "config": label, "preemptions": int(preempt.value) if preempt is not None else None,
        "recomputed_tokens": computed - needed, "paused": paused,
        "steps": int(iters.count) if iters is not None else None,
        "wall_s": wall, "output_tokens": sum(len(t) for t in tokens),
        "output_tok_per_s": sum(len(t) for t in tokens) / wall,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
        "rejected": rejected, "wrong_length": wrong, "tokens": tokens,
    }
    return row


# ---------------------------------------------------------------------------
# Fair timing: a discarded warm-up engine, then the configurations in a rotated order

def run_order(n: int, order: str, seed: int) -> list[int]:
    """Indices of n configurations in the order they run: 'given', 'reverse', or
    'shuffle' (a permutation seeded by `seed`), so no configuration always runs first
    (the first engine of a process pays cold caches)."""
    idx = list(range(n))
    if order == "reverse":
        idx.reverse()
    elif order == "shuffle":
        random.Random(seed).shuffle(idx)
    elif order != "given":
        raise ValueError(f"order={order!r}: must be 'given', 'reverse' or 'shuffle'")
    return idx


def warm_up(model_dir: str, workload: list[BenchRequest], engine: BenchEngine,
            stop_early: bool, n: int) -> None:
    """One discarded engine on the first n requests (vLLM's own scheduler), so the
    first measured engine does not pay the process's cold start."""
    if n > 0:
        row = run_one("warm-up", model_dir, workload[:n], engine, None, stop_early)
        say(f"[warm-up] a discarded engine, {min(n, len(workload))} requests: {row['steps']} steps "
            f"({_elapsed()} elapsed)", err=True)


def run_configs(configs: list[BenchConfig], model_dir: str, workload: list[BenchRequest],
                engine: BenchEngine, stop_early: bool, order: str, seed: int,
                tag: str = "") -> list[dict]:
    """Every configuration once, in run_order; rows come back in the given order, each
    with its position in the run (`run_position`, from 1)."""
    rows: list[dict | None] = [None] * len(configs)
    for pos, i in enumerate(run_order(len(configs), order, seed), 1):
        c = configs[i]
        row = run_one(c.label, model_dir, workload, engine, c.kvadmit, stop_early, c.engine_args)
        row["run_position"] = pos
        rows[i] = row
        # one line per engine, once it has run (its start-up logs go to the engine log)
        say(f"{tag}[config {pos}/{len(configs)}] {c.label}: {row['steps']} steps, "
            f"{row['preemptions']} preemptions, generate {row['wall_s']:.1f} s "
            f"({_elapsed()} elapsed)", err=True)
    return rows


_T0 = time.perf_counter()      # main() restarts it: the run's clock for the progress lines


def _elapsed() -> str:
    s = int(time.perf_counter() - _T0)
    return f"{s // 60}:{s % 60:02d}"


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else math.inf)


def ratios(row: dict, ref: dict) -> dict:
    """row / ref for steps, preemptions, recomputed tokens (and wall time where both have it)."""
    out = {k: _ratio(row[k], ref[k]) for k in ("steps", "preemptions", "recomputed_tokens")}
    if "wall_s" in row and "wall_s" in ref:
        out["wall_s"] = _ratio(row["wall_s"], ref["wall_s"])
    return out


def best_watermark(rows: list[dict]) -> str | None:
    """vLLM's best watermark among the rows, by the scorecard's rule (the
    `vllm-watermark=F` row with the fewest preemptions, then the fewest steps); None
    without such rows."""
    from kvadmit.simulate import scorecard
    if not any(r["config"].startswith("vllm-watermark=") for r in rows):
        return None
    return scorecard.best_watermark({r["config"]: r for r in rows})


def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "inf"


def print_table(rows: list[dict], sims: dict[str, dict] | None = None) -> None:
    """Steps and preemptions first (deterministic), their ratios against vllm-default and
    vLLM's best watermark, then this run's wall times (noisy: compare within one run only)."""
    by = {r["config"]: r for r in rows}
    base = by.get("vllm-default", rows[0])
    wm = best_watermark(rows)
    width = max([15] + [len(r["config"]) + 1 for r in rows])
    sim_head = f" {'sim steps':>9} {'sim pre':>7}" if sims else ""
    say(f"{'config':{width}} {'steps':>6} {'preempt':>7} {'recomp':>7} {'paused':>6} "
        f"{'steps/' + base['config'][:4]:>10} {'steps/wm':>8} {'pre/wm':>6}{sim_head} | "
        f"{'wall s':>6} {'wall/' + base['config'][:4]:>9} {'tok/s':>7} {'TTFT p50/p99 ms':>16} "
        f"{'TPOT p50/p99 ms':>16} {'rej':>4} {'same out':>8}")
    for r in rows:
        vs_base = ratios(r, base)
        vs_wm = ratios(r, by[wm]) if wm else None
        same = all(a == b for a, b in zip(r.get("tokens", []), base.get("tokens", [])))
        r["same_outputs_as_vllm_default"] = same
        sim = ""
        if sims:
            s = sims[r["config"]]
            sim = f" {s['steps']:9d} {s['preemptions']:7d}"
        say(f"{r['config'] + ('*' if r['config'] == wm else ''):{width}} {r['steps']:6d} "
            f"{r['preemptions']:7d} {r['recomputed_tokens']:7d} {r['paused']:6d} "
            f"{_fmt_ratio(vs_base['steps']):>10} "
            f"{_fmt_ratio(vs_wm['steps']) if vs_wm else '-':>8} "
            f"{_fmt_ratio(vs_wm['preemptions']) if vs_wm else '-':>6}{sim} | "
            f"{r['wall_s']:6.2f} {_fmt_ratio(vs_base['wall_s']):>9} {r['output_tok_per_s']:7.1f} "
            f"{r['ttft_p50_s'] * 1e3:7.0f}/{r['ttft_p99_s'] * 1e3:<8.0f} "
            f"{r['tpot_p50_s'] * 1e3:7.1f}/{r['tpot_p99_s'] * 1e3:<8.1f} "
            f"{sum(r['rejected'].values()):4d} {str(same):>8}")
    order = ", ".join(r["config"] for r in sorted(rows, key=lambda r: r["run_position"]))
    say(f"{'* = vLLM best watermark (fewest preemptions, then steps); ' if wm else ''}"
        f"wall times from this one run, in the order {order}", flush=True)


# ---------------------------------------------------------------------------
# Workloads

def build_workload(kind: str, requests: int, max_model_len: int, max_tokens: int, caps: str,
                   stop_early: bool, trace: str | None = None) -> tuple[list[BenchRequest], str]:
    """The bench's requests and a one-line description. kind 'azure' (the first requests
    of an Azure trace, scaled to the context) or 'synthetic'; caps 'cap' (every request
    carries max_tokens) or 'real' (max_tokens = its real output length)."""
    if kind == "synthetic":
        workload = synthetic_workload(requests, max_model_len, max_tokens, stop_early=stop_early)
        source = f"synthetic, {requests} requests, seed 0"
    elif kind == "azure":
        trace = trace or DEFAULT_TRACE
        workload = azure_workload(trace, requests, max_model_len, max_tokens)
        if not stop_early:
            workload = [BenchRequest(r.prompt_token_ids, r.max_tokens, r.max_tokens) for r in workload]
        source = f"first {requests} requests of {trace}, lengths and cap x {max_model_len}/8192"
    else:
        raise ValueError(f"workload={kind!r}: must be 'azure' or 'synthetic'")
    if caps == "real":
        workload = [BenchRequest(r.prompt_token_ids, r.output_tokens, r.output_tokens) for r in workload]
        source += "; max_tokens = real output length"
    elif caps != "cap":
        raise ValueError(f"caps={caps!r}: must be 'cap' or 'real'")
    source += f"; cap {max_tokens}; {'real lengths (EOS)' if stop_early else 'ignore_eos'}"
    return workload, source


# ---------------------------------------------------------------------------
# The suite: a few of the scorecard's kinds of workload on the real engine, beside the
# simulator's native engine on the same requests.

@dataclass(frozen=True)
class SuiteCase:
    name: str
    about: str
    kind: str                       # 'azure' | 'synthetic'
    requests: int
    engine: BenchEngine
    max_tokens: int = 2048
    caps: str = "cap"
    stop_early: bool = True


SUITE = (
    SuiteCase("azure-cap", "Azure conversation burst, max_tokens 2048 (scaled) far above the real "
              "lengths (the bench's default workload), 33 blocks", "azure", 256, BenchEngine()),
    SuiteCase("azure-real", "the same requests with max_tokens = real length", "azure", 256,
              BenchEngine(), caps="real"),
    SuiteCase("equal-burst", "synthetic burst, every request runs to max_tokens 200 (ignore_eos): "
              "equal lengths, honest caps, 24 blocks", "synthetic", 64,
              BenchEngine(num_blocks=24, max_model_len=512), max_tokens=200, stop_early=False),
    SuiteCase("loose-pool", "the Azure burst on a pool where vLLM never preempts (512 blocks)",
              "azure", 256, BenchEngine(num_blocks=512)),
)
DEFAULT_CONFIG = "kvadmit-default"
SUITE_CONFIGS = (["vllm-default"] + [f"vllm-watermark={w:g}" for w in WATERMARKS] +
                 [DEFAULT_CONFIG, "peak"])


def default_configs() -> list[str]:
    """Without --configs: vLLM's default and its watermarks, then every kvadmit config
    (the policy the empty config defaults to only once, as kvadmit-default)."""
    from kvadmit.config import AdmissionConfig
    same_as_default = {"policy": AdmissionConfig().policy}
    return (["vllm-default"] + [f"vllm-watermark={w:g}" for w in WATERMARKS] +
            [c for c, kv in CONFIGS.items() if c != "vllm-default" and kv != same_as_default])


def simulate(config: BenchConfig, workload: list[BenchRequest], engine: BenchEngine) -> dict:
    """The same requests, all queued at once, through the simulator's native engine
    model (cpu-tiny step times): its steps, preemptions, recomputed tokens, pauses."""
    from kvadmit.simulate import get_preset, run_native
    cfg, shape = config.sim(engine.sim_shape())
    raw = run_native(as_burst(workload), cfg, shape, get_preset("cpu-tiny"))
    t = raw.totals
    return {"config": config.label, "steps": t.steps, "preemptions": t.preemptions,
            "recomputed_tokens": t.recomputed_tokens,
            "paused": raw.extra["core"].get("paused", 0), "makespan_s": t.makespan_s,
            "finished": t.finished, "rejected": t.rejected}


def default_goals(rows: list[dict], sims: dict[str, dict], honest: bool) -> dict | None:
    """The scorecard's goals for the default config ({}) on this workload, met or not,
    on the real engine and in the simulator. The real engine's goals leave out the
    scorecard's modelled-time goal: wall time on a shared CPU is too noisy for it."""
    from kvadmit.simulate import scorecard
    by = {r["config"]: r for r in rows}
    if not (DEFAULT_CONFIG in by and "vllm-default" in by and best_watermark(rows)):
        return None

    def cells(src):
        return {(scorecard.DEFAULT_ROW if n == DEFAULT_CONFIG else n): c for n, c in src.items()}
    loose = by["vllm-default"]["preemptions"] == 0
    real = scorecard.goals(cells({n: {**r, "makespan_s": 0.0} for n, r in by.items()}), honest, loose)
    del real["time<=vllm"]
    return {"real": real, "sim": scorecard.goals(cells(sims), honest, loose)}


def sim_vs_real(rows: list[dict], sims: dict[str, dict]) -> dict:
    """Per config: the real and simulated ratios against vllm-default and whether the
    verdict (fewer or more steps; fewer or more preemptions) is the same."""
    by = {r["config"]: r for r in rows}
    out = {}
    for name, r in by.items():
        s = sims[name]
        cell = {"steps": [r["steps"], s["steps"]], "preemptions": [r["preemptions"], s["preemptions"]]}
        if "vllm-default" in by:
            rr, sr = ratios(r, by["vllm-default"]), ratios(s, sims["vllm-default"])
            cell["steps_vs_vllm_default"] = [rr["steps"], sr["steps"]]
            cell["preemptions_vs_vllm_default"] = [rr["preemptions"], sr["preemptions"]]
            cell["same_verdict"] = (_side(rr["steps"]) == _side(sr["steps"]) and
                                    _side(rr["preemptions"]) == _side(sr["preemptions"]))
        out[name] = cell
    return out


def _side(ratio: float, tol: float = 0.01) -> int:
    """-1 below, 0 within tol of, +1 above 1.0."""
    return 0 if abs(ratio - 1.0) <= tol else (1 if ratio > 1.0 else -1)


def run_suite(args, model_dir: str, configs: list[BenchConfig]) -> dict:
    cases = [c for c in SUITE if not args.cases or c.name in args.cases]
    out = {"command": " ".join(["kvadmit", "bench", "vllm", *args.argv]),
           "configs": {c.label: c.doc for c in configs}, "order": args.order, "seed": args.seed,
           "warmup_requests": args.warmup, "workloads": []}
    t_all = time.perf_counter()
    warmed = False
    for k, case in enumerate(cases, 1):
        n = args.requests or case.requests
        workload, source = build_workload(case.kind, n, case.engine.max_model_len,
                                          case.max_tokens, case.caps, case.stop_early, args.trace)
        if not warmed:
            warm_up(model_dir, workload, case.engine, case.stop_early, args.warmup)
            warmed = True
        say(f"\n== {case.name} ({k}/{len(cases)}): {case.about}\n   {source}; pool "
            f"{case.engine.num_blocks} blocks x {case.engine.block_size}; max_model_len "
            f"{case.engine.max_model_len}", flush=True)
        rows = run_configs(configs, model_dir, workload, case.engine, case.stop_early, args.order,
                           args.seed + k, tag=f"{case.name} ")
        sims = {c.label: simulate(c, workload, case.engine) for c in configs}
        print_table(rows, sims)
        entry = {"name": case.name, "about": case.about, "workload": source, "requests": n,
                 "engine": dataclasses.asdict(case.engine), "rows": rows,
                 "sim": sims, "sim_vs_real": sim_vs_real(rows, sims)}
        by = {r["config"]: r for r in rows}
        if "vllm-default" in by:
            entry["vs_vllm_default"] = {r["config"]: ratios(r, by["vllm-default"]) for r in rows}
        wm = best_watermark(rows)
        if wm:
            entry["best_watermark"] = wm
            entry["vs_best_watermark"] = {r["config"]: ratios(r, by[wm]) for r in rows}
        goals = default_goals(rows, sims, honest=case.caps == "real" or not case.stop_early)
        if goals:
            entry["goals"] = goals
            missed = [g for g, ok in goals["real"].items() if not ok]
            differ = [g for g, ok in goals["real"].items() if goals["sim"][g] != ok]
            say(f"{DEFAULT_CONFIG} goals on the real engine: "
                f"{'all met' if not missed else 'missed ' + ', '.join(missed)}; the simulator "
                f"{'agrees' if not differ else 'differs on ' + ', '.join(differ)}", flush=True)
        agree = [name for name, c in entry["sim_vs_real"].items() if c.get("same_verdict") is False]
        say(f"simulator vs real: steps {_sim_err(rows, sims):.1%} apart at most; verdicts vs "
            f"vllm-default {'all the same' if not agree else 'differ for ' + ', '.join(agree)}",
            flush=True)
        if not args.keep_tokens:
            for r in rows:
                r.pop("tokens")
        out["workloads"].append(entry)
    out["wall_s"] = time.perf_counter() - t_all
    say(f"\nsuite: {len(cases)} workloads x {len(configs)} configs in {out['wall_s']:.0f} s",
        flush=True)
    return out


def _sim_err(rows: list[dict], sims: dict[str, dict]) -> float:
    return max(abs(sims[r["config"]]["steps"] - r["steps"]) / r["steps"] for r in rows)


# ---------------------------------------------------------------------------

def _use_inline_engine_core() -> None:
    """vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): an engine
    starts in seconds instead of spawning two Python processes (~40 s on 2 busy cores).
    The scheduler, model runner and outputs are the same code; only the front end and
    the engine core no longer overlap, so wall times are longer."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="kvadmit bench vllm", description=__doc__.splitlines()[0],
        epilog="Configs: " + "; ".join(f"{k}: {v}" for k, v in CONFIG_DOCS.items()) +
               "; vllm-watermark=F: vLLM's --watermark F (admissions keep that share of the pool "
               "free); vllm-active=N: vLLM's --max-num-active-seqs N; vllm-queued=N: "
               + QUEUED_DOC.format("N") + "; NAME=JSON: kvadmit with those AdmissionConfig keys.")
    ap.add_argument("--suite", action="store_true",
                    help="a fixed set of workloads (azure-cap, azure-real, equal-burst, loose-pool), "
                         "each with vllm-default, vLLM's watermarks 0.01/0.05/0.1, kvadmit-default "
                         "and peak, beside the simulator's native engine on the same requests; "
                         "saves bench/results/vllm_cpu_suite.json")
    ap.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                    help=f"--suite: only these workloads (of {', '.join(c.name for c in SUITE)})")
    ap.add_argument("--workload", choices=("synthetic", "azure"), default="azure")
    ap.add_argument("--trace", default=None,
                    help="the Azure trace: a path to its CSV (optionally .gz) or a bundled trace's "
                         f"name (default: {DEFAULT_TRACE}, the copy shipped in the package)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in the workload (default 256; --suite: each workload's own)")
    ap.add_argument("--num-blocks", type=int, default=33)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM's token budget per step (default: vLLM's; --suite: 2048, the "
                         "simulator's tiny-engine shape)")
    ap.add_argument("--max-tokens", type=int, default=2048,
                    help="the cap requests carry (azure: scaled like the lengths)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request runs to max_tokens (no early stop)")
    ap.add_argument("--caps", choices=("cap", "real"), default="cap",
                    help="max_tokens each request carries: the (scaled) cap, or its real output "
                         "length (a client that knows it: what peak and reserve assume)")
    ap.add_argument("--configs", nargs="+", default=None, metavar="CONFIG",
                    help="configs to run, separated by spaces or commas (default: "
                         f"{', '.join(default_configs())}; --suite: {', '.join(SUITE_CONFIGS)}); also "
                         "vllm-watermark=F, vllm-active=N, vllm-queued=N, or NAME=JSON for a "
                         "kvadmit config (see below)")
    ap.add_argument("--order", choices=("shuffle", "given", "reverse"), default="shuffle",
                    help="the order the configs' engines run in (rows print in the given order); "
                         "shuffle: a permutation seeded by --seed (per workload in --suite)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --order shuffle")
    ap.add_argument("--warmup", type=int, default=16, metavar="N",
                    help="requests of one discarded warm-up engine run first (0: none)")
    ap.add_argument("--inline-engine-core", action=argparse.BooleanOptionalAction, default=None,
                    help="run vLLM's engine core in this process (engines start in seconds; "
                         "default with --suite) instead of its own processes (vLLM's default)")
    ap.add_argument("--model-dir", default=str(DEFAULT_DIR),
                    help="where the tiny random-weight Llama is built (if missing)")
    ap.add_argument("--model", default=None,
                    help="use this local model instead of the tiny one (its eos id must be 2 "
                         "for real-length stops, or pass --ignore-eos)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", default=None,
                    help="write the rows here ('' to skip; default "
                         "bench/results/vllm_cpu_{workload}.json, --suite: vllm_cpu_suite.json)")
    ap.add_argument("--plot", default="bench/results/vllm_cpu_{workload}.png",
                    help="write a PNG comparison here ('' to skip; not with --suite)")
    ap.add_argument("--keep-tokens", action="store_true", help="keep token ids in the JSON")
    ap.add_argument("--log", default=None,
                    help="where vLLM's engine output goes (its INFO logs, progress bars; the "
                         "terminal shows one line per engine, the table, and each distinct "
                         "warning or error once). Default: beside the JSON, .log for .json (a "
                         "temporary file without a JSON); '' lets vLLM print to the terminal")
    args = ap.parse_args(argv)
    args.argv = argv
    try:
        configs = [parse_config(c) for c in
                   split_configs(args.configs or (SUITE_CONFIGS if args.suite else default_configs()))]
        if args.cases and not args.suite:
            raise ValueError("--cases needs --suite")
        unknown = set(args.cases or ()) - {c.name for c in SUITE}
        if unknown:
            raise ValueError(f"--cases {', '.join(sorted(unknown))}: not one of "
                             f"{', '.join(c.name for c in SUITE)}")
    except ValueError as e:
        ap.error(str(e))
    if args.inline_engine_core if args.inline_engine_core is not None else args.suite:
        _use_inline_engine_core()

    if args.suite:
        args.json = "bench/results/vllm_cpu_suite.json" if args.json is None else args.json
    else:
        args.json = (args.json if args.json is not None else "bench/results/vllm_cpu_{workload}.json")
        args.json = args.json.format(workload=args.workload) if args.json else None
        args.plot = args.plot.format(workload=args.workload) if args.plot else None
    if args.log is None:
        import tempfile
        args.log = (str(pathlib.Path(args.json).with_suffix(".log")) if args.json else
                    str(pathlib.Path(tempfile.gettempdir()) /
                        f"kvadmit-bench-vllm-{'suite' if args.suite else args.workload}.log"))
    global _T0
    _T0 = time.perf_counter()
    with engine_log(args.log):
        return _run(args, argv, configs)


def _run(args, argv: list[str], configs: list[BenchConfig]) -> int:
    from kvadmit.vllm.tiny_model import build_tiny_llama
    model_dir = args.model or str(build_tiny_llama(args.model_dir))
    if args.suite:
        out = run_suite(args, model_dir, configs)
        if args.json:
            _save(args.json, out, args)
        return 0

    stop_early = not args.ignore_eos
    engine = BenchEngine(args.num_blocks, args.block_size, args.max_model_len, args.max_num_seqs,
                         args.max_num_batched_tokens, args.dtype)
    workload, source = build_workload(args.workload, args.requests or 256, args.max_model_len,
                                      args.max_tokens, args.caps, stop_early, args.trace)
    say(f"workload: {source}; pool {args.num_blocks} blocks x {args.block_size}; "
        f"max_model_len {args.max_model_len}", flush=True)
    warm_up(model_dir, workload, engine, stop_early, args.warmup)
    rows = run_configs(configs, model_dir, workload, engine, stop_early, args.order, args.seed)
    print_table(rows)
    if not args.keep_tokens:
        for r in rows:
            r.pop("tokens")
    if args.json:
        _save(args.json, {"command": " ".join(["kvadmit", "bench", "vllm", *argv]),
                          "workload": source, "configs": {c.label: c.doc for c in configs},
                          "rows": rows}, args)
    if args.plot:
        _plot(rows, args.plot, source)
        say(f"saved {args.plot}")
    return 0


def _save(path: str, out: dict, args) -> None:
    out["args"] = {k: v for k, v in vars(args).items() if k != "argv"}
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(out, indent=2))
    say(f"saved {path}")


# The chart's families and marks: a colour per family, a hatch and a bold label for the
# three rows a reader compares (vLLM's default, vLLM's best knob, kvadmit's default).
PLOT_COLOURS = {"vLLM": "#8c9db5", "kvadmit": "#4daf7c"}
PLOT_MARKS = {"vLLM's default": ("//", "#2c3e50"), "vLLM's best knob": ("xx", "#2c3e50"),
              "kvadmit's default": ("..", "#145a32")}


def plot_marks(rows: list[dict]) -> dict[str, str]:
    """config -> its mark (PLOT_MARKS' names) for the rows that carry one: vllm-default,
    vLLM's best watermark (best_watermark's rule), and kvadmit-default."""
    marks = {}
    wm = best_watermark(rows)
    names = {r["config"] for r in rows}
    for config, mark in (("vllm-default", "vLLM's default"), (wm, "vLLM's best knob"),
                         (DEFAULT_CONFIG, "kvadmit's default")):
        if config in names:
            marks[config] = mark
    return marks


def _plot(rows: list[dict], path: str, title: str):
    """Horizontal bars, one row per config (labels read level), coloured by family,
    the three reference rows hatched and named in the legend; saves a PNG at `path`
    and returns the (closed) figure."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [r["config"] for r in rows]
    families = ["vLLM" if n.startswith("vllm-") else "kvadmit" for n in names]
    marks = plot_marks(rows)
    fig, axes = plt.subplots(1, 3, figsize=(14, 1.6 + 0.36 * len(rows)), sharey=True)
    ys = range(len(rows))
    for ax, key, label, fmt in zip(axes, ("preemptions", "steps", "output_tok_per_s"),
                                   ("preemptions (fewer is better)", "engine steps (fewer is better)",
                                    "output tokens/s (this run's wall time)"),
                                   ("{:.0f}", "{:.0f}", "{:.0f}")):
        values = [r[key] for r in rows]
        bars = ax.barh(ys, values, color=[PLOT_COLOURS[f] for f in families], height=0.7)
        for bar, name in zip(bars, names):
            if name in marks:
                hatch, edge = PLOT_MARKS[marks[name]]
                bar.set_hatch(hatch)
                bar.set_edgecolor(edge)
                bar.set_linewidth(1.2)
        top = max(values) if values and max(values) > 0 else 1
        for y, v in zip(ys, values):
            ax.text(v + top * 0.01, y, fmt.format(v), va="center", fontsize=8)
        ax.set_xlim(0, top * 1.15)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_yticks(list(ys))
    axes[0].set_yticklabels(names, fontsize=9)
    for tick, name in zip(axes[0].get_yticklabels(), names):
        if name in marks:
            tick.set_fontweight("bold")
    axes[0].invert_yaxis()
    legend = [Patch(facecolor=PLOT_COLOURS["vLLM"], label="vLLM's scheduler and its knobs"),
              Patch(facecolor=PLOT_COLOURS["kvadmit"], label="kvadmit's policies")]
    legend += [Patch(facecolor="white", hatch=PLOT_MARKS[m][0], edgecolor=PLOT_MARKS[m][1],
                     label=f"{m}: {n}") for n, m in marks.items()]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.suptitle("\n".join(textwrap.wrap(f"kvadmit bench vllm: {title}", 130)), fontsize=9)
    fig.tight_layout(rect=(0, 0.07 if len(rows) > 6 else 0.12, 1, 1))
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


if __name__ == "__main__":
    sys.exit(main())
