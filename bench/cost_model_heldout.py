"""The cost model (`{"shortfall": "cost"}`) against vLLM's default and kvadmit's
default, on the scorecard's workloads and on eight it was not shaped on.

The held-out ones: two more Azure slices with no max_tokens (caps = the context
left), one with max_tokens 2048 scaled, one with honest caps on 48 blocks, a
512-token-context slice on a 16-block pool, and three equal-length bursts of other
shapes (48 x 150 tokens on 16 blocks, 96 x 100 on 32, 64 x 300 on 40; prompts
16-128, other seeds). All on the native engine with the CPU engine's step-time fit,
requests queued at once. Per row: steps and modelled time against vLLM's default,
preemptions, recomputed tokens against vLLM's, and p99 TPOT against vLLM's (the
scorecard's: kvadmit.simulate.metrics). Prints the table and the geometric
means and maxima per config; saves bench/results/cost_model_heldout.json.

    python bench/cost_model_heldout.py
"""
from __future__ import annotations

import json
import math
import sys

from _common import save

from kvadmit.config import AdmissionConfig
from kvadmit.simulate import run_native
from kvadmit.simulate.metrics import percentile, request_latencies
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.scorecard import azure_burst, equal_burst, suite, tiny_shape
from kvadmit.simulate.steptime import CPU_TINY

AZURE = "azure2023_conv"
CONFIGS = {"default": {}, "cost": {"shortfall": "cost"}}


def held_out():
    return [
        ("azure-context-3000", azure_burst(AZURE, 3000, 256, "context", "x"), tiny_shape(32)),
        ("azure-context-9000", azure_burst(AZURE, 9000, 256, "context", "x"), tiny_shape(32)),
        ("azure-cap-15000", azure_burst(AZURE, 15000, 256, "cap", "x"), tiny_shape(32)),
        ("azure-honest-18000", azure_burst(AZURE, 18000, 256, "real", "x"), tiny_shape(48)),
        ("tight-5000", azure_burst(AZURE, 5000, 256, "context", "x", 512), tiny_shape(16, 512)),
        ("equal-48x150", equal_burst(48, 150, seed=3), tiny_shape(16, 512)),
        ("equal-96x100", equal_burst(96, 100, seed=4), tiny_shape(32, 512)),
        ("equal-64x300", equal_burst(64, 300, seed=5), tiny_shape(40, 512)),
    ]


def tpot_p99(run) -> float:
    return percentile(sorted(request_latencies(run.per_request)[1]), 99)


def main() -> int:
    cases = [(c.name, c.workload, c.shape, c.step, "scorecard") for c in suite()]
    cases += [(name, w, shape, CPU_TINY, "held-out") for name, w, shape in held_out()]
    rows = []
    for name, w, shape, step, kind in cases:
        ref = run_native(w, parse_policy("vllm-default").config(AdmissionConfig()), shape, step)
        row = {"workload": name, "set": kind, "vllm-default": {
            "steps": ref.totals.steps, "preemptions": ref.totals.preemptions,
            "recomputed_tokens": ref.totals.recomputed_tokens, "tpot_p99_s": tpot_p99(ref)}}
        line = f"{name:20} vLLM {ref.totals.preemptions:4} / {ref.totals.steps:6}"
        for label, cfg in CONFIGS.items():
            r = run_native(w, AdmissionConfig(**cfg), shape, step)
            t = r.totals
            if t.finished + t.rejected != len(w) or t.free_blocks_at_end != shape.num_blocks:
                raise AssertionError(f"{name}/{label}: lost a request or a block")
            cell = {"steps": t.steps, "preemptions": t.preemptions,
                    "recomputed_tokens": t.recomputed_tokens, "tpot_p99_s": tpot_p99(r),
                    "steps_vs_vllm": t.steps / ref.totals.steps,
                    "time_vs_vllm": t.makespan_s / ref.totals.makespan_s,
                    "recompute_vs_vllm": t.recomputed_tokens / max(1, ref.totals.recomputed_tokens),
                    "tpot_p99_vs_vllm": tpot_p99(r) / tpot_p99(ref)}
            row[label] = cell
            line += (f" | {label} {t.preemptions:3} / {t.steps:6} steps x{cell['steps_vs_vllm']:.3f}"
                     f" time x{cell['time_vs_vllm']:.3f} TPOT99 x{cell['tpot_p99_vs_vllm']:.2f}")
        print(line, flush=True)
        rows.append(row)
    summary = {}
    for label in CONFIGS:
        for kind in ("scorecard", "held-out"):
            cells = [r[label] for r in rows if r["set"] == kind]
            summary[f"{label}/{kind}"] = {
                key: {"geomean": math.exp(sum(math.log(c[key]) for c in cells) / len(cells)),
                      "max": max(c[key] for c in cells)}
                for key in ("steps_vs_vllm", "time_vs_vllm", "tpot_p99_vs_vllm")}
    for name, s in summary.items():
        print(f"{name:20} " + "  ".join(f"{k} geo {v['geomean']:.3f} max {v['max']:.3f}"
                                         for k, v in s.items()))
    path = save("cost_model_heldout", {"configs": CONFIGS, "rows": rows, "summary": summary})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
