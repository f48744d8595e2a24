"""What `kvadmit bench vllm` shows and saves: the table (ratios against vLLM's default
and its best watermark), the JSON and the chart."""
from __future__ import annotations

import json
import math
import pathlib

from kvadmit.bench.vllm.configs import DEFAULT_CONFIG
from kvadmit.vllm.engine_log import say

def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else math.inf)


def ratios(row: dict, ref: dict) -> dict:
    """row / ref for steps, preemptions, recomputed tokens (and modelled and wall time
    where both have them)."""
    out = {k: _ratio(row[k], ref[k]) for k in ("steps", "preemptions", "recomputed_tokens")}
    for k in ("modelled_s", "wall_s"):
        if k in row and k in ref:
            out[k] = _ratio(row[k], ref[k])
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
    vLLM's best watermark, then the modelled time and tokens/s (the steps priced by the
    step-time fit: deterministic too), then this run's wall time (noisy: one run)."""
    by = {r["config"]: r for r in rows}
    base = by.get("vllm-default", rows[0])
    wm = best_watermark(rows)
    width = max([15] + [len(r["config"]) + 1 for r in rows])
    sim_head = f" {'sim steps':>9} {'sim pre':>7}" if sims else ""
    say(f"{'config':{width}} {'steps':>6} {'preempt':>7} {'recomp':>7} {'paused':>6} "
        f"{'steps/' + base['config'][:4]:>10} {'steps/wm':>8} {'pre/wm':>6}{sim_head} | "
        f"{'model s':>7} {'tok/s':>6} {'wall s':>6} {'TTFT p50/p99 ms':>16} "
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
            f"{r.get('modelled_s', math.nan):7.2f} {r.get('modelled_tok_per_s', math.nan):6.0f} "
            f"{r['wall_s']:6.2f} "
            f"{r['ttft_p50_s'] * 1e3:7.0f}/{r['ttft_p99_s'] * 1e3:<8.0f} "
            f"{r['tpot_p50_s'] * 1e3:7.1f}/{r['tpot_p99_s'] * 1e3:<8.1f} "
            f"{sum(r['rejected'].values()):4d} {str(same):>8}")
    order = ", ".join(r["config"] for r in sorted(rows, key=lambda r: r["run_position"]))
    say(f"{'* = vLLM best watermark (fewest preemptions, then steps); ' if wm else ''}"
        f"model s and tok/s: the steps priced by the CPU step-time fit (T = a + b*tokens + "
        f"c*context, bench/results/cpu_step_time.json); wall s: this one run, noisy, in the "
        f"order {order}", flush=True)


def save_json(path: str, out: dict, args) -> None:
    """Writes a run's JSON at `path`, with the command line's arguments."""
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


def plot(rows: list[dict], path: str, title: str):
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
    for ax, key, label, fmt in zip(axes, ("preemptions", "steps", "modelled_tok_per_s"),
                                   ("preemptions (fewer is better)", "engine steps (fewer is better)",
                                    "output tokens/s, modelled: the steps priced by\nthe CPU "
                                    "step-time fit (not one run's wall time)"),
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
