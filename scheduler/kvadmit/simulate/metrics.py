"""From a run's per-request times to the numbers users compare.

TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1)
(0 for one-token outputs). A request meets the SLO if it was served, its TTFT
<= its TTFT target and its TPOT <= its TPOT target (the workload's per-request
targets where it has them, else the run's `Slo`); goodput is the share of all
requests (refused ones included) that meet it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvadmit.simulate.record import Totals


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise ValueError(f"slo_ttft_s={self.ttft_s}: must be > 0")
        if not self.tpot_s > 0:
            raise ValueError(f"slo_tpot_s={self.tpot_s}: must be > 0")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list; nan if empty."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 100)) - 1))
    return sorted_values[k]


def request_latencies(per_request: dict) -> tuple[list[float], list[float], list[bool]]:
    """TTFT and TPOT of every served request, and whether each request was served."""
    ttft, tpot, served = [], [], []
    for a, f, d, n, rej in zip(per_request["arrival_s"], per_request["first_token_s"],
                               per_request["finish_s"], per_request["output_tokens"],
                               per_request["rejected"]):
        ok = rej is None and f >= 0
        served.append(ok)
        if ok:
            ttft.append(f - a)
            tpot.append((d - f) / (n - 1) if n > 1 else 0.0)
    return ttft, tpot, served


def summarize(per_request: dict, totals: Totals, slo: Slo, ttft_slo_s: list[float] | None = None,
              tpot_slo_s: list[float] | None = None) -> dict:
    n = len(per_request["arrival_s"])
    ttft, tpot, served = request_latencies(per_request)
    served_idx = [i for i, ok in enumerate(served) if ok]
    good = 0
    for t, p, i in zip(ttft, tpot, served_idx):
        # a per-request target of 0 is "none" (as in the core), not the run's SLO
        t_max = slo.ttft_s if ttft_slo_s is None else (ttft_slo_s[i] or math.inf)
        p_max = slo.tpot_s if tpot_slo_s is None else (tpot_slo_s[i] or math.inf)
        good += t <= t_max and p <= p_max
    rejected: dict[str, int] = {}
    for r in per_request["rejected"]:
        if r is not None:
            rejected[r] = rejected.get(r, 0) + 1
    span = totals.makespan_s
    st, sp = sorted(ttft), sorted(tpot)
    return {
        "requests": n, "finished": sum(served), "rejected": rejected,
        "goodput": good / n if n else 0.0,
        "good_rps": good / span if span > 0 else 0.0,
        "throughput_tok_s": totals.output_tokens / span if span > 0 else 0.0,
        "ttft_p50_s": percentile(st, 50), "ttft_p99_s": percentile(st, 99),
        "tpot_p50_s": percentile(sp, 50), "tpot_p99_s": percentile(sp, 99),
        "preemptions": totals.preemptions, "recomputed_tokens": totals.recomputed_tokens,
        "steps": totals.steps, "makespan_s": span,
        "kv_util_mean": totals.kv_util_mean, "kv_util_peak": totals.kv_util_peak,
        "prefix_hit_rate": (totals.prefix_hit_tokens / totals.prefix_query_tokens
                            if totals.prefix_query_tokens else 0.0),
    }
