"""Compare policies on one workload, find an engine's capacity, sweep the load."""
from __future__ import annotations

import json
import pathlib
import sys
import time
from dataclasses import replace

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, RawRun, run_native
from kvadmit.simulate.metrics import Slo, summarize
from kvadmit.simulate.policies import PolicySpec
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import Workload

CAPACITY_SAMPLE = 4000


def recorded_command() -> str | None:
    """The `kvadmit simulate ...` command line, for a results file (None when not run as it)."""
    return "kvadmit simulate " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["simulate"] else None


def load_entry(load: float | None, workload: Workload, rows: list[dict]) -> dict:
    """One load point of a results file. A burst (every request at one instant) is a
    workload like any other; it has no rate."""
    return {"load": load,
            "offered_rps": offered_rps(workload) if workload.open_loop_span_s() > 0 else None,
            "rows": rows}


def save_json(out: dict, path: str) -> None:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"saved {path}")


def pyplot():
    """matplotlib's pyplot (Agg), or None with a note on stderr when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvadmit: --plot needs matplotlib (pip install matplotlib); no plot written",
              file=sys.stderr)
        return None
    return plt


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def progress_line(label: str, what: str = "requests done"):
    """A progress line on stderr, refreshed at most twice a second; call with done=None to clear."""
    last = [0.0]

    def report(done, total):
        now = time.monotonic()
        if done is None:
            print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
        elif now - last[0] >= 0.5 or done == total:
            last[0] = now
            print(f"\r  {label}: {done}/{total} {what}", end="", file=sys.stderr, flush=True)
    return report


def run_policy(workload: Workload, spec: PolicySpec, engine: str, shape: EngineShape,
               step: StepTimeModel, base: AdmissionConfig, model_dir: str | None = None,
               progress=None) -> RawRun:
    w = workload.with_oracle_caps() if spec.oracle else workload
    if not spec.kvadmit:
        w = w.without_kvadmit_fields()
    shape = spec.shape(shape)
    if engine == "native":
        if spec.vllm_args:
            raise ValueError(f"policy {spec.name}: the native engine model does not model "
                             f"{', '.join(spec.vllm_args)}; run it with --engine vllm")
        return run_native(w, spec.config(base), shape, step, progress=progress)
    if engine == "vllm":
        from kvadmit.simulate.vllm_engine import run_vllm
        if model_dir is None:
            raise ValueError("--engine vllm needs a model directory (--model-dir)")
        from vllm.engine.arg_utils import EngineArgs
        unknown = [k for k in spec.vllm_args if k not in EngineArgs.__dataclass_fields__]
        if unknown:
            from vllm import __version__
            raise ValueError(f"policy {spec.name}: the installed vLLM {__version__} has no "
                             f"{', '.join(unknown)} (vLLM 0.34 has)")
        return run_vllm(w, None if spec.vllm_own else spec.config(base), shape, step, model_dir,
                        progress=progress, engine_args=dict(spec.vllm_args))
    raise ValueError(f"engine={engine!r}: must be 'native' or 'vllm'")


def compare(workload: Workload, policies: list[PolicySpec], engine: str, shape: EngineShape,
            step: StepTimeModel, base: AdmissionConfig, slo: Slo, model_dir: str | None = None,
            show_progress: bool = True) -> tuple[list[dict], dict[str, RawRun]]:
    rows, raws = [], {}
    if workload.ttft_slo_s is None:   # requests carry the SLO they are measured against
        workload = replace(workload, ttft_slo_s=[slo.ttft_s] * len(workload),
                           tpot_slo_s=[slo.tpot_s] * len(workload))
    for spec in policies:
        prog = progress_line(spec.name) if show_progress else None
        raw = run_policy(workload, spec, engine, shape, step, base, model_dir, prog)
        if prog:
            prog(None, None)
        raws[spec.name] = raw
        rows.append({"policy": spec.name, "engine": engine, "wall_s": raw.wall_s,
                     **summarize(raw.per_request, raw.totals, slo, workload.ttft_slo_s,
                                 workload.tpot_slo_s)})
    return rows, raws


def capacity_rps(workload: Workload, shape: EngineShape, step: StepTimeModel,
                 sample: int = CAPACITY_SAMPLE) -> float:
    """Requests/s the engine completes when saturated: the first `sample` open-loop
    requests all queued at once under vLLM's rule (overcommit, LIFO victim) on the
    native engine; completed requests / makespan."""
    idx = [i for i in range(len(workload)) if workload.is_open(i)][:sample]
    n = len(idx)
    sat = Workload(name=workload.name, arrival_s=[0.0] * n,
                   prompt_tokens=[workload.prompt_tokens[i] for i in idx],
                   output_tokens=[workload.output_tokens[i] for i in idx],
                   max_tokens=[workload.max_tokens[i] for i in idx])
    raw = run_native(sat, AdmissionConfig(policy="overcommit", victim="lifo"),
                     replace(shape, prefix_caching=False), step)
    t = raw.totals
    if t.finished == 0 or t.makespan_s <= 0:
        raise ValueError(f"workload {workload.name}: no request of the first {n} completes on "
                         f"this engine shape (rejections: {t.rejected}), so it has "
                         f"no capacity to scale --load by")
    return t.finished / t.makespan_s


def offered_rps(workload: Workload) -> float:
    n = sum(1 for i in range(len(workload)) if workload.is_open(i))
    span = workload.open_loop_span_s()
    if n < 2 or span <= 0:
        raise ValueError(f"workload {workload.name}: needs two or more arrivals spread in time "
                         f"to have a rate")
    return (n - 1) / span


def at_load(workload: Workload, load: float, capacity: float) -> Workload:
    """The workload with its arrivals rescaled to offer `load` x capacity."""
    if not load > 0:
        raise ValueError(f"load={load}: must be > 0")
    return workload.scaled(load * capacity / offered_rps(workload))
