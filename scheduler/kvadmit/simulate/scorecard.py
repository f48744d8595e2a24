"""`kvadmit bench scorecard`: every baseline and every kvadmit config on a fixed
suite of workloads, on the native engine model, with nothing tuned per workload.

Each cell is one run; each row of a workload's table is compared with vLLM's
default (`vllm-default`) and with vLLM's best watermark on that workload (the
`vllm-watermark=F` row with the fewest preemptions, then the fewest steps): the
strongest one-flag setting a vLLM user has. Steps are the throughput measure of
a burst (the same work in fewer steps); open-loop workloads also report goodput.
The goals of the default config (`{}`) are checked per workload and printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Callable

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.frontier import plot_frontier
from kvadmit.simulate.metrics import Slo, summarize
from kvadmit.simulate.policies import PolicySpec, parse_policy
from kvadmit.simulate.run import at_load, capacity_rps, run_policy
from kvadmit.simulate.steptime import CPU_TINY, PRESETS, StepTimeModel, get_preset
from kvadmit.simulate.workload import Workload, agent_sessions, from_trace, synthetic
from kvadmit.traces import load_trace, trace_name

# The traces' file names in a --traces folder (one holding the originals);
# without one the scorecard reads the copies bundled in the package (kvadmit/data/).
AZURE = "azure2023_conv.csv"
MOONCAKE = "mooncake_conversation_trace.jsonl"
WATERMARKS = (0.01, 0.05, 0.1)
# The rows of every workload: vLLM's default and its own knobs, SGLang's rule, and
# kvadmit's configs (`default` is the empty config, what `--scheduler-cls` alone gives;
# `default-sglang` is what it resolves to in SGLang, which cannot pause a request;
# `cost` is the opt-in cost model, docs/policies.md#the-cost-model).
CONFIGS = (["vllm-default"] + [f"vllm-watermark={w:g}" for w in WATERMARKS] +
           ["sglang", "peak", "adaptive",
            'adaptive+pause={"policy": "adaptive", "shortfall": "pause", "adaptive_quantile": 0.4, '
            '"adaptive_max_quantile": 0.4, "adaptive_min_samples": 1, "head_of_line": "bypass", '
            '"max_bypass": 1000, "bypass_lookahead": 256}',
            'default-sglang={"shortfall": "preempt"}', 'cost={"shortfall": "cost"}', "default={}"])
DEFAULT_ROW = "default"
# --engine vllm adds the knobs only vLLM's own scheduler runs (vLLM 0.34's cache-aware
# admission window: on the workloads with prefix caching; the others have no cell).
VLLM_ENGINE_CONFIGS = CONFIGS[:4] + ["vllm-active=16", "vllm-prefill-interval=4",
                                     "vllm-cache-window=64"] + CONFIGS[4:]


@dataclass(frozen=True)
class Case:
    """One workload of the suite, on its engine."""
    name: str
    about: str
    workload: Workload
    shape: EngineShape
    step: StepTimeModel
    slo: Slo = Slo()

    @property
    def tiny_context(self) -> bool:
        """Whether it fits the tiny CPU model's context (what --engine vllm can run)."""
        return self.shape.max_model_len <= TINY_CONTEXT


# ---------------------------------------------------------------------------
# Workloads. Bursts run on the tiny CPU engine's shape (the one `kvadmit bench
# vllm` runs for real): trace lengths scaled from an 8k to a 1024-token context.

TINY_CONTEXT = 1024
TRACE_CONTEXT = 8192


def tiny_shape(num_blocks: int, max_model_len: int = TINY_CONTEXT) -> EngineShape:
    return EngineShape(num_blocks=num_blocks, block_size=32, max_model_len=max_model_len,
                       max_num_seqs=64, max_num_batched_tokens=2048)


def azure_burst(path: pathlib.Path, start: int, n: int, caps: str, name: str,
                context: int = TINY_CONTEXT) -> Workload:
    """Trace requests [start, start + n) queued at once, scaled to the tiny context.
    caps: 'context' (no max_tokens: the context left), 'cap' (2048 scaled, at least
    the real length) or 'real' (max_tokens = the real length)."""
    scale = context / TRACE_CONTEXT
    reqs = load_trace(path, limit=start + n)[start:]
    prompt, out, mx = [], [], []
    for r in reqs:
        p = max(1, min(context - 2, round(r.prompt_tokens * scale)))
        room = context - p
        o = max(1, min(room, round(r.output_tokens * scale)))
        m = {"context": room, "cap": max(o, min(room, round(2048 * scale))), "real": o}[caps]
        prompt.append(p)
        out.append(o)
        mx.append(m)
    return Workload(name=name, arrival_s=[0.0] * len(reqs), prompt_tokens=prompt,
                    output_tokens=out, max_tokens=mx,
                    description=f"{trace_name(path)} requests {start}-{start + n - 1} at once, scaled "
                                f"to a {context}-token context, max_tokens rule '{caps}'")


def equal_burst(n: int, output: int, seed: int = 0) -> Workload:
    """n requests at once, prompts 16-128 tokens, every output exactly `output` tokens
    (ignore_eos), max_tokens = output: honest caps, synchronized lengths."""
    import random
    rng = random.Random(seed)
    prompt = [rng.randint(16, 128) for _ in range(n)]
    return Workload(name="equal", arrival_s=[0.0] * n, prompt_tokens=prompt,
                    output_tokens=[output] * n, max_tokens=[output] * n,
                    description=f"{n} requests at once, every output {output} tokens "
                                f"(max_tokens = {output}), prompts 16-128")


def open_loop(w: Workload, shape: EngineShape, step: StepTimeModel, load: float) -> Workload:
    return at_load(w, load, capacity_rps(w, shape, step))


def suite(traces_dir: str | pathlib.Path | None = None, quick: bool = False,
          step: StepTimeModel | None = None) -> list[Case]:
    """The scorecard's workloads, from the bundled traces (``traces_dir`` None) or from a
    folder holding AZURE and MOONCAKE. ``quick``: smaller versions (tests). ``step``:
    every workload priced by this step-time model instead of its own (the regime: the
    same pools and requests, open-loop arrivals at that model's capacity)."""
    if traces_dir is None:
        azure, moon = "azure2023_conv", "mooncake_conversation"     # kvadmit.traces.BUNDLED
    else:
        azure, moon = pathlib.Path(traces_dir) / AZURE, pathlib.Path(traces_dir) / MOONCAKE
    k = 4 if quick else 1                    # quick: a quarter of the requests
    cpu = step or CPU_TINY                   # the bursts' price: the CPU engine's fit, by default
    cases: list[Case] = []

    def add(name, about, build: Callable[[], tuple[Workload, EngineShape, StepTimeModel]], **kw):
        w, shape, step = build()
        cases.append(Case(name, about, w, shape, step, **kw))

    add("azure-context", "Azure conversation burst, no max_tokens (caps = context left), 32 blocks",
        lambda: (azure_burst(azure, 0, 256 // k, "context", "azure-context"), tiny_shape(32), cpu))
    add("azure-cap", "another Azure slice, max_tokens 2048 (scaled) far above real lengths, 32 blocks",
        lambda: (azure_burst(azure, 6000, 256 // k, "cap", "azure-cap"), tiny_shape(32), cpu))
    add("azure-honest", "a third Azure slice with honest caps (max_tokens = real length), 32 blocks",
        lambda: (azure_burst(azure, 12000, 256 // k, "real", "azure-honest"), tiny_shape(32), cpu))
    add("equal-burst", "64 requests of exactly 200 output tokens (ignore_eos, honest caps), 24 blocks",
        lambda: (equal_burst(64 // k, 200), tiny_shape(24, 512), cpu))
    add("tight-pool", "Azure burst scaled to a 512-token context, caps = context left, on a tight "
        "pool (16 blocks: 1 context)",
        lambda: (azure_burst(azure, 2000, 256 // k, "context", "tight", 512), tiny_shape(16, 512), cpu))
    add("loose-pool", "Azure burst, caps = context left, on a pool where vLLM never preempts (512 blocks)",
        lambda: (azure_burst(azure, 0, 256 // k, "context", "loose"), tiny_shape(512), cpu))

    h100 = get_preset("h100-8b")
    gpu = step or h100                      # the open-loop workloads' price (their pools are h100's)
    big = EngineShape(num_blocks=h100.num_blocks // 8, block_size=h100.block_size,
                      max_model_len=h100.max_model_len, max_num_seqs=1024, max_num_batched_tokens=8192)

    def gamma():
        w = synthetic(2000 // k, rate=10.0, seed=1, burst_cv=4.0, max_model_len=big.max_model_len)
        return open_loop(w, big, gpu, 1.2), big, gpu
    add("gamma-bursty", "synthetic Gamma-burst arrivals (CV 4) at 1.2x capacity, lognormal lengths, "
        "caps = min(2048, context left); h100-8b step model, 1/8 of its KV pool", gamma)

    def mooncake():
        shape = dataclasses.replace(big, prefix_caching=True, max_model_len=131072,
                                    num_blocks=h100.num_blocks)
        w = from_trace(moon, limit=1500 // k, max_tokens_rule="context",
                       max_model_len=shape.max_model_len)
        return open_loop(w, shape, gpu, 1.0), shape, gpu
    add("mooncake-prefix", "Mooncake conversation trace with prefix caching at 1.0x capacity, "
        "caps = min(2048, context left); h100-8b", mooncake, slo=Slo(10.0, 0.1))

    def agents():
        shape = dataclasses.replace(big, prefix_caching=True, max_model_len=32768)
        w = agent_sessions(200 // k, rate=2.0, seed=3, max_model_len=shape.max_model_len,
                           block_tokens=shape.block_size)
        return w, shape, gpu
    add("agents", "multi-turn agent sessions with a shared system prompt, prefix caching; "
        "h100-8b, 1/8 of its KV pool", agents, slo=Slo(5.0, 0.1))
    return cases


# ---------------------------------------------------------------------------

def run_cell(case: Case, spec: PolicySpec, model_dir: str | None = None) -> dict:
    """One run on the native engine model, or (``model_dir``) on vLLM's real
    scheduler in-process (`kvadmit.simulate.vllm_engine`)."""
    raw = run_policy(case.workload, spec, "native" if model_dir is None else "vllm", case.shape,
                     case.step, AdmissionConfig(), model_dir)
    t = raw.totals
    s = summarize(raw.per_request, t, case.slo)
    if t.finished + t.rejected != len(case.workload) or t.free_blocks_at_end != case.shape.num_blocks:
        raise AssertionError(f"{case.name}/{spec.name}: lost a request or a block")
    return {"steps": t.steps, "preemptions": t.preemptions,
            "recomputed_tokens": t.recomputed_tokens,
            "paused": raw.extra.get("core", {}).get("paused", 0),
            "goodput": s["goodput"], "throughput_tok_s": s["throughput_tok_s"],
            "makespan_s": t.makespan_s, "ttft_p99_s": s["ttft_p99_s"],
            "tpot_p99_s": s["tpot_p99_s"],
            "finished": t.finished, "rejected": t.rejected, "wall_s": raw.wall_s}


def best_watermark(cells: dict[str, dict]) -> str:
    marks = [n for n in cells if n.startswith("vllm-watermark=")]
    return min(marks, key=lambda n: (cells[n]["preemptions"], cells[n]["steps"]))


def ratios(cell: dict, ref: dict) -> dict:
    def r(k):
        a, b = cell[k], ref[k]
        return a / b if b else (1.0 if a == b else math.inf)
    return {"steps": r("steps"), "preemptions": r("preemptions"),
            "recomputed_tokens": r("recomputed_tokens"), "goodput": r("goodput"),
            "makespan": r("makespan_s"), "throughput": r("throughput_tok_s"),
            "ttft_p99": r("ttft_p99_s"), "tpot_p99": r("tpot_p99_s")}


def goals(cells: dict[str, dict], honest: bool, loose: bool) -> dict[str, bool]:
    """Issue 12's goals for the default config on one workload."""
    d, v = cells[DEFAULT_ROW], cells["vllm-default"]
    wm = cells[best_watermark(cells)]
    g = {
        "preemptions<=10%_of_vllm": d["preemptions"] <= 0.1 * v["preemptions"],
        "fewer_preemptions_than_best_watermark_at_its_steps":
            (d["preemptions"] < wm["preemptions"] or d["preemptions"] == 0)
            and d["steps"] <= wm["steps"],
        "steps<=vllm": d["steps"] <= v["steps"],
        # the same output in no more modelled time (steps weighted by their tokens:
        # a step that recomputes a preempted prompt costs more than a decode step)
        "time<=vllm": d["makespan_s"] <= v["makespan_s"] * 1.0000001,
        "recomputed<=vllm": d["recomputed_tokens"] <= v["recomputed_tokens"],
    }
    if honest:
        g["honest_caps_no_preemption"] = d["preemptions"] == 0
    if loose:
        g["loose_pool_same_steps"] = abs(d["steps"] - v["steps"]) <= 0.01 * v["steps"]
    return g


def score(cases: list[Case], configs: list[str], progress=None, model_dir: str | None = None) -> dict:
    specs = [parse_policy(c) for c in configs]
    out = {"engine": "native" if model_dir is None else "vllm",
           "configs": {s.name: s.doc for s in specs}, "workloads": []}
    for case in cases:
        cells = {}
        for spec in specs:
            if "cache_aware_admission_window" in spec.vllm_args and not case.shape.prefix_caching:
                continue        # vLLM turns the window off without prefix caching
            if progress:
                progress(f"{case.name} / {spec.name}")
            cells[spec.name] = run_cell(case, spec, model_dir)
        entry = {"name": case.name, "about": case.about, "workload": case.workload.description,
                 "requests": len(case.workload), "shape": dataclasses.asdict(case.shape),
                 "step_time": case.step.name, "slo": dataclasses.asdict(case.slo), "cells": cells}
        if "vllm-default" in cells:
            entry["vs_vllm_default"] = {n: ratios(c, cells["vllm-default"]) for n, c in cells.items()}
        if "vllm-default" in cells and any(n.startswith("vllm-watermark=") for n in cells):
            wm = best_watermark(cells)
            entry["best_watermark"] = wm
            entry["vs_best_watermark"] = {n: ratios(c, cells[wm]) for n, c in cells.items()}
            if DEFAULT_ROW in cells:
                entry["goals"] = goals(cells, honest=case.workload.max_tokens == case.workload.output_tokens,
                                       loose=cells["vllm-default"]["preemptions"] == 0)
        out["workloads"].append(entry)
    return out


def tpot_ms(cell: dict) -> str:
    """A cell's p99 time per output token (the simulator's per-request mean), '-' when
    nothing decoded (files recorded before the column have none)."""
    t = cell.get("tpot_p99_s", math.nan)
    return f"{'-':>7}" if math.isnan(t) else f"{t * 1000:5.0f}ms"


def print_scorecard(out: dict) -> None:
    for e in out["workloads"]:
        print(f"\n== {e['name']}: {e['about']} ({e['requests']} requests)")
        wm = e.get("best_watermark")
        print(f"{'config':18} {'steps':>7} {'preempt':>7} {'recomp':>7} {'paused':>7} {'goodput':>7}"
              f" {'steps/vllm':>10} {'steps/wm':>8} {'time/vllm':>9} {'pre/vllm':>8} {'pre/wm':>7}"
              f" {'TTFT99/vllm':>11} {'TPOTp99':>7}")
        for name, c in e["cells"].items():
            rv = e.get("vs_vllm_default", {}).get(name, {})
            rw = e.get("vs_best_watermark", {}).get(name, {})
            mark = " *" if name == wm else ""
            print(f"{name + mark:18} {c['steps']:7d} {c['preemptions']:7d} {c['recomputed_tokens']:7d} "
                  f"{c['paused']:7d} {c['goodput'] * 100:6.1f}% {rv.get('steps', math.nan):10.3f} "
                  f"{rw.get('steps', math.nan):8.3f} {rv.get('makespan', math.nan):9.3f} "
                  f"{rv.get('preemptions', math.nan):8.3f} "
                  f"{rw.get('preemptions', math.nan):7.3f} {rv.get('ttft_p99', math.nan):11.3f} "
                  f"{tpot_ms(c)}")
        if "goals" in e:
            missed = [k for k, ok in e["goals"].items() if not ok]
            print(f"default config goals: {'all met' if not missed else 'MISSED ' + ', '.join(missed)}")
    print("\n* = vLLM's best watermark on that workload (fewest preemptions, then fewest steps)")


# The regime table's columns: a cell's ratio to vLLM's default on the same regime.
REGIME_RATIOS = (("steps", "steps"), ("makespan", "time"), ("throughput", "tok/s"),
                 ("ttft_p99", "TTFT99"), ("tpot_p99", "TPOT99"))


def print_regimes(regimes: list[dict], row: str = DEFAULT_ROW) -> None:
    """One table over the regimes (one scorecard per step-time model): per workload and
    regime, `row`'s preemptions against vLLM's default's, then its ratios to vLLM's
    default (steps, modelled time, tokens/s, TTFT p99, TPOT p99; below 1 is better but
    for tokens/s)."""
    print(f"\n== {row} against vLLM's default, per step-time regime")
    print(f"{'workload':16} {'regime':11} {'preempt':>9}" + "".join(f" {h:>7}" for _, h in REGIME_RATIOS))
    names = [e["name"] for e in regimes[0]["workloads"]]
    for name in names:
        for reg in regimes:
            e = next(w for w in reg["workloads"] if w["name"] == name)
            if row not in e["cells"] or "vllm-default" not in e["cells"]:
                continue
            pre = f"{e['cells'][row]['preemptions']}/{e['cells']['vllm-default']['preemptions']}"
            rv = e["vs_vllm_default"][row]
            print(f"{name:16} {reg['step_time']:11} {pre:>9}" +
                  "".join(f" {rv[k]:7.3f}" for k, _ in REGIME_RATIOS))


def plot_heatmap(out: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvadmit: the scorecard's PNG needs matplotlib; none written", file=sys.stderr)
        return False
    ws = [e for e in out["workloads"] if "vs_vllm_default" in e]
    names = list(ws[0]["cells"])
    fig, axes = plt.subplots(2, 1, figsize=(1.25 * len(ws) + 3.5, 0.9 * len(names) + 2.5))
    for ax, key, title in ((axes[0], "steps", "steps / vLLM default's (< 1: same work in fewer steps)"),
                           (axes[1], "preemptions", "preemptions (colour: / vLLM default's)")):
        grid, text = [], []
        for n in names:
            row, trow = [], []
            for e in ws:
                c, v = e["cells"][n], e["cells"]["vllm-default"]
                if c["finished"] == 0:            # refused everything (e.g. could never run)
                    row.append(math.nan)
                    trow.append("refused")
                elif key == "steps":
                    row.append(e["vs_vllm_default"][n]["steps"])
                    trow.append(f"{row[-1]:.2f}")
                else:
                    row.append(c["preemptions"] / max(v["preemptions"], 1))
                    trow.append(str(c["preemptions"]))
            grid.append(row)
            text.append(trow)
        cmap = plt.get_cmap("RdYlGn_r").copy()
        cmap.set_bad("lightgrey")
        im = ax.imshow(grid, cmap=cmap, vmin=0.8 if key == "steps" else 0.0,
                       vmax=1.2 if key == "steps" else 1.0, aspect="auto")
        ax.set_xticks(range(len(ws)), [e["name"] for e in ws], rotation=25, ha="right", fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        for i in range(len(names)):
            for j in range(len(ws)):
                ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.03)
    fig.suptitle("kvadmit bench scorecard (native engine model); 'default' = kvadmit with no configuration",
                 fontsize=10)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvadmit bench scorecard", description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=None,
                    help=f"a folder with {AZURE} and {MOONCAKE} (default: the copies bundled "
                         "in the package)")
    ap.add_argument("--configs", nargs="+", default=None, metavar="CONFIG",
                    help="rows: simulator policy names (vllm-default, vllm-watermark=F, vllm-active=N, "
                         "vllm-prefill-interval=N and vllm-cache-window=N with --engine vllm, "
                         "sglang, peak, adaptive, ...) or NAME=JSON kvadmit configs (default: "
                         "vLLM's default and knobs, SGLang's rule, kvadmit's configs)")
    ap.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads")
    ap.add_argument("--quick", action="store_true", help="a quarter of each workload's requests")
    ap.add_argument("--engine", choices=("native", "vllm"), default="native",
                    help="vllm: vLLM's real V1 scheduler in-process on the virtual clock (needs vLLM; "
                         "by default only the bursts on the tiny CPU engine's shape)")
    ap.add_argument("--model-dir", help="--engine vllm: the tiny model (built there if missing)")
    ap.add_argument("--step-time", nargs="+", metavar="PRESET", choices=sorted(PRESETS),
                    help="price every workload by each of these step-time models in turn (one "
                         "scorecard each, and one table of the default against vLLM across them: "
                         "cpu-tiny is the CPU engine's fit, h100-8b and h100x4-70b GPU rooflines); "
                         "default: each workload's own")
    ap.add_argument("--frontier", default="", metavar="PNG",
                    help="also the frontier chart: per workload, each config's preemptions "
                         "against its modelled time and its TTFT p99 (kvadmit.simulate.frontier)")
    ap.add_argument("--json", help="default: bench/results/scorecard[_vllm].json")
    ap.add_argument("--plot", help="default: bench/results/scorecard[_vllm].png ('' for none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.configs is None:
        args.configs = CONFIGS if args.engine == "native" else VLLM_ENGINE_CONFIGS
    suffix = "" if args.engine == "native" else "_vllm"
    args.json = f"bench/results/scorecard{suffix}.json" if args.json is None else args.json
    args.plot = f"bench/results/scorecard{suffix}.png" if args.plot is None else args.plot
    for c in args.configs:                  # a bad row is named before any workload runs
        try:
            parse_policy(c)
        except ValueError as e:            # ConfigError is one
            print(f"kvadmit bench scorecard: --configs: {e}", file=sys.stderr)
            return 2
    try:
        runs = [(name, _cases(args, get_preset(name) if name else None))
                for name in (args.step_time or [None])]
    except FileNotFoundError as e:
        print(f"kvadmit bench scorecard: {e} (pass --traces)", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvadmit bench scorecard: {e}", file=sys.stderr)
        return 2
    model_dir = None
    if args.engine == "vllm":
        try:
            from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
        except ImportError as e:
            print(f"kvadmit bench scorecard: --engine vllm needs vLLM ({e})", file=sys.stderr)
            return 2
        model_dir = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    t0 = time.perf_counter()

    def progress(what):
        print(f"\r  {what:60}", end="", file=sys.stderr, flush=True)
    regimes = []
    for name, cases in runs:
        out = score(cases, list(args.configs), lambda w: progress(f"{name or ''} {w}"), model_dir)
        print("\r" + " " * 64 + "\r", end="", file=sys.stderr)
        out["step_time"] = name or "own"
        if name:
            print(f"\n#### step-time regime {name}: {get_preset(name).name}")
        print_scorecard(out)
        regimes.append(out)
        if args.plot and plot_heatmap(out, _suffixed(args.plot, name)):
            print(f"saved {_suffixed(args.plot, name)}")
        if args.frontier and plot_frontier(out, _suffixed(args.frontier, name)):
            print(f"saved {_suffixed(args.frontier, name)}")
    out = regimes[0] if not args.step_time else {"regimes": regimes}
    if args.step_time:
        print_regimes(regimes)
    out["command"] = "kvadmit bench scorecard " + " ".join(argv if argv is not None else sys.argv[3:])
    out["seconds"] = time.perf_counter() - t0
    print(f"\n{len(runs[0][1])} workloads x {len(args.configs)} configs x {len(runs)} regime(s) "
          f"in {out['seconds']:.1f} s")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"saved {args.json}")
    return 0


def _cases(args, step: StepTimeModel | None) -> list[Case]:
    """The suite under `step` (None: each workload's own), narrowed by --only (or, with
    --engine vllm, to what the tiny model's context holds). ValueError names an unknown
    workload."""
    cases = suite(args.traces, quick=args.quick, step=step)
    if args.only:
        unknown = set(args.only) - {c.name for c in cases}
        if unknown:
            raise ValueError(f"unknown workload(s) {sorted(unknown)}; known: {[c.name for c in cases]}")
        return [c for c in cases if c.name in args.only]
    return [c for c in cases if c.tiny_context] if args.engine == "vllm" else cases


def _suffixed(path: str, regime: str | None) -> str:
    """The plot's path for one regime: `scorecard_h100-8b.png` beside `scorecard.png`."""
    return path if regime is None else str(pathlib.Path(path).with_stem(f"{pathlib.Path(path).stem}_{regime}"))
