"""Issue 3's goal on `kvadmit bench vllm`'s workload, explored in the simulator.

The native engine model replays the benchmark's workload (first 256 Azure
conversation requests scaled to a 1024-token context, all queued at once, 32
usable blocks of 32 tokens, the cpu-tiny step model) and reproduces the real CPU
engine's schedule (1300 steps / 51 preemptions for vLLM's rule, 1472 / 5 for
`adaptive`). Here it maps steps against preemptions for `adaptive` settings and for
the oracle (peak with true lengths): the goal is <= 5 preemptions and <= 1300 steps.
The last rows use min_samples 1 and unlimited bypass, with the quantile fixed
(adaptive_max_quantile = adaptive_quantile) or raised by the controller, each
preempting and pausing (shortfall: "pause") on a shortfall. A last table runs the
bench's `adaptive+pause` setting against vLLM's rule on other bursts and pools.
Needs vLLM installed (the workload builder lives in kvadmit.bench.vllm).

    python bench/bench_adaptive_frontier.py
"""
from __future__ import annotations

from _common import save

from kvadmit.config import AdmissionConfig
from kvadmit.simulate import EngineShape, get_preset, run_native
from kvadmit.bench.vllm import CONFIGS, as_burst, azure_workload, synthetic_workload

BYPASS = dict(head_of_line="bypass", max_bypass=1000, bypass_lookahead=256)


def shape_of(num_blocks: int, max_model_len: int) -> EngineShape:
    return EngineShape(num_blocks=num_blocks, block_size=32, max_model_len=max_model_len,
                       max_num_seqs=64, max_num_batched_tokens=2048)


def other_workloads(step) -> list[dict]:
    """The bench's `adaptive+pause` setting (tuned on the workload above) against
    vLLM's rule on other bursts and pool sizes."""
    trace = "azure2023_conv"      # the copy bundled in the package (kvadmit/data/)
    cases = [("azure 512 requests, 32 blocks", as_burst(azure_workload(trace, 512, 1024, 2048)), 32, 1024),
             ("azure 256 requests, 64 blocks", as_burst(azure_workload(trace, 256, 1024, 2048)), 64, 1024),
             ("azure 512 requests, 128 blocks", as_burst(azure_workload(trace, 512, 1024, 2048)), 128, 1024),
             ("synthetic 256 requests, 23 blocks", as_burst(synthetic_workload(256, 512, 200)), 23, 512),
             ("synthetic 256 requests, 64 blocks", as_burst(synthetic_workload(256, 512, 200)), 64, 512)]
    rows = []
    print(f"{'workload':36} {'vLLM rule steps/preempt':>24} {'adaptive+pause':>15} {'steps ratio':>11}")
    for name, w, blocks, mml in cases:
        base = run_native(w, AdmissionConfig(policy="overcommit"), shape_of(blocks, mml), step).totals
        ours = run_native(w, AdmissionConfig(**CONFIGS["adaptive+pause"]), shape_of(blocks, mml), step).totals
        rows.append({"workload": name, "vllm_rule": [base.steps, base.preemptions],
                     "adaptive_pause": [ours.steps, ours.preemptions],
                     "steps_ratio": ours.steps / base.steps})
        print(f"{name:36} {base.steps:>17}/{base.preemptions:<6} "
              f"{ours.steps:>9}/{ours.preemptions:<5} {rows[-1]['steps_ratio']:11.3f}")
    return rows


def main() -> None:
    w = as_burst(azure_workload("azure2023_conv", 256, 1024, 2048))
    shape = shape_of(32, 1024)
    step = get_preset("cpu-tiny")
    runs = [("vllm rule", w, dict(policy="overcommit")),
            ("oracle", w.with_oracle_caps(), dict(policy="peak")),
            ("oracle bypass", w.with_oracle_caps(), dict(policy="peak", **BYPASS))]
    for q in (0.3, 0.5, 0.7, 0.9):
        for ms in (1, 8):
            runs.append((f"adaptive q={q} min_samples={ms}", w,
                         dict(policy="adaptive", adaptive_quantile=q, adaptive_min_samples=ms)))
            runs.append((f"adaptive q={q} min_samples={ms} bypass", w,
                         dict(policy="adaptive", adaptive_quantile=q, adaptive_min_samples=ms, **BYPASS)))
    for q in (0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7):
        for fixed in (True, False):
            for shortfall in ("preempt", "pause"):
                cfg = dict(policy="adaptive", shortfall=shortfall, adaptive_quantile=q,
                           adaptive_min_samples=1, **BYPASS)
                if fixed:
                    cfg["adaptive_max_quantile"] = q
                runs.append((f"adaptive q={q}{' fixed' if fixed else ''} bypass {shortfall}", w, cfg))
    rows = []
    print(f"{'config':42} {'steps':>6} {'preempt':>8} {'recomputed':>10} {'paused':>7}")
    for name, wl, cfg in runs:
        r = run_native(wl, AdmissionConfig(**cfg), shape, step)
        t = r.totals
        rows.append({"config": name, "settings": cfg, "steps": t.steps,
                     "preemptions": t.preemptions, "recomputed_tokens": t.recomputed_tokens,
                     "paused": r.extra["core"]["paused"]})
        print(f"{name:42} {t.steps:6d} {t.preemptions:8d} {t.recomputed_tokens:10d} "
              f"{rows[-1]['paused']:7d}")
    others = other_workloads(step)
    print(f"saved {save('adaptive_frontier', {'rows': rows, 'other_workloads': others})}")


if __name__ == "__main__":
    main()
