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
from kvadmit.vllm.scheduler import KvadmitAsyncScheduler, KvadmitScheduler
from kvadmit.vllm.tiny_model import DEFAULT_DIR, EOS_TOKEN_ID

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
            core = getattr(self, "kvadmit_core", None)
            paused = core.paused if core is not None else 0
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


def run_one(label: str, model_dir: str, workload: list[BenchRequest], num_blocks: int,
            block_size: int, max_model_len: int, kvadmit: dict | None, stop_early: bool,
            max_num_seqs: int = 64, dtype: str = "float32") -> dict:
    """One engine, one generate call; returns the row of numbers for `label`."""
    from vllm import LLM, SamplingParams

    import tempfile
    counts = pathlib.Path(tempfile.mkstemp(prefix="kvadmit-bench-")[1])
    os.environ[COUNTS_ENV] = str(counts)
    os.environ[EXPECT_ENV] = str(len(workload))
    kwargs = dict(scheduler_cls="kvadmit.vllm.bench.CountingScheduler")
    if kvadmit is not None:
        kwargs["additional_config"] = {"kvadmit": kvadmit}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, block_size=block_size,
              num_gpu_blocks_override=num_blocks, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, enforce_eager=True, seed=0, gpu_memory_utilization=0.3,
              disable_log_stats=False, enable_prefix_caching=False,
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


CONFIGS = {"vllm-default": None, **{p: {"policy": p} for p in POLICIES},
           # adaptive with every knob for throughput: a fixed optimistic quantile (no
           # raising), unlimited bypass, and pausing instead of preempting on a shortfall.
           "adaptive+pause": {"policy": "adaptive", "shortfall": "pause", "adaptive_quantile": 0.4,
                              "adaptive_max_quantile": 0.4, "adaptive_min_samples": 1,
                              "head_of_line": "bypass", "max_bypass": 1000, "bypass_lookahead": 256}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvadmit bench vllm", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("synthetic", "azure"), default="azure")
    ap.add_argument("--trace", default=None, help="Azure CSV (default: ../shared/traces/azure2023_conv.csv)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=33)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=2048,
                    help="the cap requests carry (azure: scaled like the lengths)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request runs to max_tokens (no early stop)")
    ap.add_argument("--caps", choices=("cap", "real"), default="cap",
                    help="max_tokens each request carries: the (scaled) cap, or its real output "
                         "length (a client that knows it: what peak and reserve assume)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS),
                    help=f"any of {', '.join(CONFIGS)}, or name=JSON for a kvadmit config")
    ap.add_argument("--model-dir", default=str(DEFAULT_DIR),
                    help="where the tiny random-weight Llama is built (if missing)")
    ap.add_argument("--model", default=None,
                    help="use this local model instead of the tiny one (its eos id must be 2 "
                         "for real-length stops, or pass --ignore-eos)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", default="bench/results/vllm_cpu_{workload}.json",
                    help="write the rows here ('' to skip)")
    ap.add_argument("--plot", default="bench/results/vllm_cpu_{workload}.png",
                    help="write a PNG comparison here ('' to skip)")
    ap.add_argument("--keep-tokens", action="store_true", help="keep token ids in the JSON")
    args = ap.parse_args(argv)
    args.json = args.json.format(workload=args.workload) if args.json else None
    args.plot = args.plot.format(workload=args.workload) if args.plot else None

    from kvadmit.vllm.tiny_model import build_tiny_llama
    model_dir = args.model or str(build_tiny_llama(args.model_dir))
    stop_early = not args.ignore_eos
    if args.workload == "synthetic":
        workload = synthetic_workload(args.requests, args.max_model_len, args.max_tokens,
                                      stop_early=stop_early)
        source = f"synthetic, {args.requests} requests, seed 0"
    else:
        trace = args.trace or str(pathlib.Path("..") / "shared" / "traces" / "azure2023_conv.csv")
        workload = azure_workload(trace, args.requests, args.max_model_len, args.max_tokens)
        if not stop_early:
            workload = [BenchRequest(r.prompt_token_ids, r.max_tokens, r.max_tokens) for r in workload]
        source = (f"first {args.requests} requests of {trace}, lengths and cap x "
                  f"{args.max_model_len}/8192")
    if args.caps == "real":
        workload = [BenchRequest(r.prompt_token_ids, r.output_tokens, r.output_tokens) for r in workload]
        source += "; max_tokens = real output length"
    print(f"workload: {source}; cap {args.max_tokens}; {'real lengths (EOS)' if stop_early else 'ignore_eos'}; "
          f"pool {args.num_blocks} blocks x {args.block_size}; max_model_len {args.max_model_len}",
          flush=True)
    rows = []
    for i, name in enumerate(args.configs, 1):
        label, _, js = name.partition("=")
        cfg = json.loads(js) if js else CONFIGS[label]
        print(f"[{i}/{len(args.configs)}] {label}: starting an engine ...", file=sys.stderr, flush=True)
        rows.append(run_one(label, model_dir, workload, args.num_blocks, args.block_size,
                            args.max_model_len, cfg, stop_early, args.max_num_seqs, args.dtype))
        r = rows[-1]
        print(f"[{i}/{len(args.configs)}] {label}: {r['preemptions']} preemptions, {r['steps']} steps, "
              f"{r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    base = rows[0]
    print(f"{'config':15} {'preempt':>7} {'recomp':>7} {'paused':>6} {'steps':>6} {'wall s':>7} {'tok/s':>7} "
          f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'rej':>4} {'same out':>8}")
    for r in rows:
        same = all(a == b for a, b in zip(r["tokens"], base["tokens"]))
        r["same_outputs_as_first"] = same
        print(f"{r['config']:15} {r['preemptions']:7d} {r['recomputed_tokens']:7d} {r['paused']:6d} {r['steps']:6d} "
              f"{r['wall_s']:7.2f} {r['output_tok_per_s']:7.1f} "
              f"{r['ttft_p50_s'] * 1e3:7.0f}/{r['ttft_p99_s'] * 1e3:<8.0f} "
              f"{r['tpot_p50_s'] * 1e3:7.1f}/{r['tpot_p99_s'] * 1e3:<8.1f} "
              f"{sum(r['rejected'].values()):4d} {str(same):>8}")
    if not args.keep_tokens:
        for r in rows:
            r.pop("tokens")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps({
            "command": " ".join(["kvadmit", "bench", "vllm", *(argv if argv is not None else sys.argv[1:])]),
            "workload": source, "args": vars(args), "rows": rows}, indent=2))
        print(f"saved {args.json}")
    if args.plot:
        _plot(rows, args.plot, source)
        print(f"saved {args.plot}")
    return 0


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("preemptions", "steps", "output_tok_per_s"),
                              ("preemptions", "engine steps", "output tokens/s")):
        ax.bar(names, [r[key] for r in rows], color=["#888"] + ["#3a7"] * (len(rows) - 1))
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
