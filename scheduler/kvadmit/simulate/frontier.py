"""The scorecard's frontier chart: per workload, every config's preemptions against its
modelled time and against its TTFT p99 (each over vLLM's default's), so a config that
no other beats on both shows as a corner. vLLM's own knobs are one family, kvadmit's
configs another; vLLM's default and kvadmit's default are marked."""
from __future__ import annotations

import pathlib

from kvadmit.simulate.run import pyplot

# (the ratio key of `vs_vllm_default`, its axis label)
AXES = (("makespan", "modelled time / vLLM default's"), ("ttft_p99", "TTFT p99 / vLLM default's"))


def plot_frontier(out: dict, path: str, default_row: str = "default") -> bool:
    """One column per workload, one row per AXES entry; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    ws = [e for e in out["workloads"] if "vs_vllm_default" in e]
    fig, axes = plt.subplots(len(AXES), len(ws), figsize=(2.9 * len(ws) + 1, 5.6), squeeze=False)
    for j, e in enumerate(ws):
        for i, (key, label) in enumerate(AXES):
            ax = axes[i][j]
            for name, cell in e["cells"].items():
                x, y = cell["preemptions"], e["vs_vllm_default"][name][key]
                vllm = name.startswith("vllm-")
                style = dict(marker="s" if vllm else "o", color="#4575b4" if vllm else "#1a9850",
                             s=22, alpha=0.8)
                if name in ("vllm-default", default_row):
                    style.update(s=90, edgecolor="black", linewidth=1.5,
                                 color="black" if vllm else "#1a9850")
                ax.scatter([x], [y], **style)
                if name in ("vllm-default", default_row) or (vllm and "watermark" not in name):
                    ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.axhline(1.0, color="#bbb", lw=0.8, ls=":")
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if i == 0:
                ax.set_title(e["name"], fontsize=8)
            if i == len(AXES) - 1:
                ax.set_xlabel("preemptions", fontsize=7)
            if j == 0:
                ax.set_ylabel(label, fontsize=7)
    fig.suptitle(f"kvadmit bench scorecard, step time {out.get('step_time', 'own')}: squares vLLM "
                 f"and its knobs, circles kvadmit's configs; large: vLLM's default (black) and "
                 f"kvadmit's default (green)", fontsize=8)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
