"""What `kvadmit bench agents` reports (kvadmit.bench.agents): each config's summary
and derived series, issue 43's goal figures, the Markdown table, the chart."""
from __future__ import annotations

import bisect
import json
import math
import pathlib

MIDDLE = (0.2, 0.8)      # the middle phase: from 20% to 80% of all turns done
HIT_WINDOW_S = 2.0       # the chart's hit rate: over the last 2 s of samples


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def _derive(run: dict, system_tokens: int) -> None:
    """Adds to every sample: turns done, the prompt tokens prefilled (queries - hits)
    and recomputed (prefilled - an unbounded cache's, for the turns whose first token
    came by then), and the hit rate over the last HIT_WINDOW_S seconds."""
    ok = [r for r in run["turns"] if "end_s" in r]
    ends = sorted(r["end_s"] for r in ok)
    firsts = sorted((r["first_s"], r["ideal_prefill"]) for r in ok)
    ideal_cum = [0]
    for _, x in firsts:
        ideal_cum.append(ideal_cum[-1] + x)
    first_times = [f for f, _ in firsts]
    series = run["series"]
    j = 0
    for i, p in enumerate(series):
        p["turns_done"] = bisect.bisect_right(ends, p["t"])
        if "queries" not in p:
            continue
        p["prefilled"] = p["queries"] - p["hits"]
        ideal = system_tokens + ideal_cum[bisect.bisect_right(first_times, p["t"])]
        p["recomputed"] = p["prefilled"] - ideal
        while series[j]["t"] < p["t"] - HIT_WINDOW_S or "queries" not in series[j]:
            j += 1
        dq = p["queries"] - series[j]["queries"]
        p["hit_rate_2s"] = (p["hits"] - series[j]["hits"]) / dq if dq > 0 else None


def _middle(series: list[dict], expected: int) -> dict:
    """The middle phase (MIDDLE of the turns done): its span and its prefix hit rate."""
    pts = [p for p in series if "queries" in p]
    lo = next((p for p in pts if p["turns_done"] >= MIDDLE[0] * expected), None)
    hi = next((p for p in reversed(pts) if p["turns_done"] <= MIDDLE[1] * expected), None)
    if lo is None or hi is None or hi["t"] <= lo["t"]:
        return {"middle_s": None, "hit_rate_middle": None}
    dq = hi["queries"] - lo["queries"]
    return {"middle_s": [lo["t"], hi["t"]],
            "hit_rate_middle": (hi["hits"] - lo["hits"]) / dq if dq > 0 else None}


def summarize(run: dict, wl, block: int) -> dict:
    """A config's figures from its turns and its last /metrics sample."""
    _derive(run, wl.system_tokens)
    turns, series = run["turns"], run["series"]
    ok = [r for r in turns if "end_s" in r]
    expected = wl.sessions * wl.turns
    last = next((p for p in reversed(series) if "queries" in p), {})
    queries, hits = last.get("queries", 0.0), last.get("hits", 0.0)
    out_tokens = sum(r["output_tokens"] for r in ok)
    span = [p for p in series if p["t"] <= run["makespan_s"] and "kv_usage" in p]
    ttft = [r["ttft_s"] for r in ok]
    lat = [r["latency_s"] for r in ok]
    ideal = wl.system_tokens + sum(r["ideal_prefill"] for r in ok)
    s = {"config": run["config"], "sessions": wl.sessions, "turns_expected": expected,
         "turns_done": len(ok), "turns_lost": expected - len(ok),
         "errors": sorted({r["error"] for r in turns if "error" in r})[:5],
         "timed_out": run["timed_out"], "makespan_s": run["makespan_s"],
         "output_tokens": out_tokens,
         "output_tok_per_s": out_tokens / run["makespan_s"] if run["makespan_s"] > 0 else None,
         "prompt_tokens_sent": sum(r["prompt_tokens"] for r in ok),
         "prefix_queries": queries, "prefix_hits": hits,
         "hit_rate": hits / queries if queries else None,
         **_middle(series, expected),
         "preemptions": last.get("preemptions"),
         "prefilled_tokens": queries - hits, "ideal_prefill_tokens": ideal,
         "recomputed_tokens": queries - hits - ideal,
         "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
         "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
         "longest_wait_s": max(ttft, default=None),
         "kv_usage_mean": sum(p["kv_usage"] for p in span) / len(span) if span else None,
         "kv_usage_max": max((p["kv_usage"] for p in span), default=None),
         "samples": len(series)}
    window = [p["agent_window"] for p in series if "agent_window" in p]
    if window:
        s["agent_window_min"], s["agent_window_max"] = min(window), max(window)
        # sessions taken out of the window (all whys) and let in after agent_max_wait_s
        s["window_exits"] = series[-1].get("window_exits", 0.0)
        s["window_overdue"] = series[-1].get("window_overdue", 0.0)
    return s


def goal_figures(summaries: list[dict]) -> dict:
    """Issue 43's goals for each kvadmit config: its speedup (makespan ratio) over
    vLLM's default and over the best vllm-seqs=N, its middle-phase hit rate, turns
    lost, and the longest wait."""
    by = {s["config"]: s for s in summaries}
    seqs = [s for s in summaries if s["config"].startswith("vllm-seqs")]
    best = min(seqs, key=lambda s: s["makespan_s"], default=None)
    out: dict = {"best_vllm_seqs": best["config"] if best else None}
    for s in summaries:
        if s["config"].startswith("vllm-"):
            continue
        g = {"hit_rate_middle": s["hit_rate_middle"], "turns_lost": s["turns_lost"],
             "longest_wait_s": s["longest_wait_s"]}
        if "vllm-default" in by:
            g["speedup_vs_vllm_default"] = by["vllm-default"]["makespan_s"] / s["makespan_s"]
        if best:
            g["speedup_vs_best_vllm_seqs"] = best["makespan_s"] / s["makespan_s"]
        if "vllm-default" in by and "vllm-bound" in by:
            g["gap_closed"] = gap_closed(s, by["vllm-default"], by["vllm-bound"])
        out[s["config"]] = g
    return out


def gap_share(x, base, bound, floor: float):
    """The share of `base`'s gap to `bound` that `x` closes ((x - base) / (bound - base));
    None where a figure is missing or the gap is under `floor`."""
    if None in (x, base, bound) or abs(bound - base) < floor:
        return None
    return (x - base) / (bound - base)


def gap_closed(s: dict, vllm: dict, bound: dict) -> dict:
    """The share of vLLM's default's gap to the never-evicting pool `s` closes, in
    makespan (none under 1% of vLLM's) and in the middle phase's hit rate (none under
    0.01)."""
    return {"makespan_s": gap_share(s.get("makespan_s"), vllm.get("makespan_s"),
                                    bound.get("makespan_s"), 0.01 * (vllm.get("makespan_s") or 0)),
            "hit_rate_middle": gap_share(s.get("hit_rate_middle"), vllm.get("hit_rate_middle"),
                                         bound.get("hit_rate_middle"), 0.01)}


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(summaries: list[dict], wl) -> None:
    print(f"\n{wl.sessions} agent sessions x {wl.turns} turns, all starting together; shared "
          f"{wl.system_tokens}-token prefix, {wl.task_tokens}-token task, {wl.output_tokens} "
          f"tokens a turn, {wl.tool_tokens}-token tool output after a tool wait of mean "
          f"{wl.tool_wait_s:g} s\n")
    print("| config | makespan s | output tok/s | prefix hit rate (all / middle) | preemptions "
          "| recomputed prompt tokens | TTFT p50/p99 s | turn latency p50/p99 s "
          "| longest wait s | turns done |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s['config']} | {s['makespan_s']:.1f} | {_f(s['output_tok_per_s'], '.0f')} | "
              f"{_f(s['hit_rate'], '.2f')} / {_f(s['hit_rate_middle'], '.2f')} | "
              f"{_f(s['preemptions'], '.0f')} | {s['recomputed_tokens']:.0f} | "
              f"{_f(s['ttft_p50_s'], '.2f')}/{_f(s['ttft_p99_s'], '.2f')} | "
              f"{_f(s['latency_p50_s'], '.2f')}/{_f(s['latency_p99_s'], '.2f')} | "
              f"{_f(s['longest_wait_s'], '.1f')} | {s['turns_done']}/{s['turns_expected']} |")
    print(flush=True)


def plot(out: dict, path: str) -> None:
    """Per config over time: KV usage, the prefix hit rate (last 2 s), the recomputed
    prompt tokens and the preemptions (both cumulative), and kvadmit's agent window
    where one moved."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("kv_usage", "KV cache usage"), ("hit_rate_2s", "prefix hit rate (last 2 s)"),
              ("recomputed", "recomputed prompt tokens (cum.)"),
              ("preemptions", "preemptions (cum.)"))
    if any(c["summary"].get("agent_window_max") != c["summary"].get("agent_window_min")
           for c in out["configs"]):          # a window that moved: its size too
        panels += (("agent_window", "kvadmit agent window W"),)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.5 * len(panels)), sharex=True)
    styles = ({"color": "black", "ls": "--"}, {"color": "#4575b4", "ls": "-."},
              {"color": "#1a9850", "lw": 2}, {"color": "#d95f02", "lw": 2},
              {"color": "#7b3294"}, {"color": "#999"})
    for i, run in enumerate(out["configs"]):
        moved = run["summary"].get("agent_window_max") != run["summary"].get("agent_window_min")
        for ax, (key, _) in zip(axes, panels):
            if key == "agent_window" and not moved:
                continue                  # a window that is off (its gauge stays at init)
            pts = [(p["t"], p[key]) for p in run["series"] if p.get(key) is not None]
            ax.plot([t for t, _ in pts], [y for _, y in pts], label=run["config"],
                    **styles[i % len(styles)])
    for ax, (key, label) in zip(axes, panels):
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        if key in ("kv_usage", "hit_rate_2s"):
            ax.set_ylim(-0.03, 1.03)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("time since the sessions started (s)")
    fig.suptitle("\n".join(textwrap.wrap(f"{out['command']} ({out['machine']['cpus']} CPUs, "
                                         f"vLLM {out['machine']['vllm']}, {out['date']})", 110)),
                 fontsize=8)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def save(out: dict, json_path: str, plot_path: str) -> None:
    if json_path:
        pathlib.Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(json_path).write_text(json.dumps(out, indent=1))
        print(f"saved {json_path}")
    if plot_path:
        plot(out, plot_path)
        print(f"saved {plot_path}")
