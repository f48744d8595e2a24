"""`kvadmit bench vllm --suite`: a few of the scorecard's kinds of workload on the real
engine, beside the simulator's native engine on the same requests."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from kvadmit.simulate.scorecard import WATERMARKS
from kvadmit.bench.vllm.configs import DEFAULT_CONFIG, BenchConfig, BenchEngine
from kvadmit.bench.vllm.output import best_watermark, print_table, ratios
from kvadmit.bench.vllm.run import run_configs, warm_up
from kvadmit.bench.vllm.workload import BenchRequest, as_burst, build_workload
from kvadmit.vllm.engine_log import say


@dataclass(frozen=True)
class SuiteCase:
    name: str
    about: str
    kind: str                       # 'azure' | 'synthetic'
    requests: int
    engine: BenchEngine
    max_tokens: int = 2048
    caps: str = "cap"
    stop_early: bool = True


SUITE = (
    SuiteCase("azure-cap", "Azure conversation burst, max_tokens 2048 (scaled) far above the real "
              "lengths (the bench's default workload), 33 blocks", "azure", 256, BenchEngine()),
    SuiteCase("azure-real", "the same requests with max_tokens = real length", "azure", 256,
              BenchEngine(), caps="real"),
    SuiteCase("equal-burst", "synthetic burst, every request runs to max_tokens 200 (ignore_eos): "
              "equal lengths, honest caps, 24 blocks", "synthetic", 64,
              BenchEngine(num_blocks=24, max_model_len=512), max_tokens=200, stop_early=False),
    SuiteCase("loose-pool", "the Azure burst on a pool where vLLM never preempts (512 blocks)",
              "azure", 256, BenchEngine(num_blocks=512)),
)
SUITE_CONFIGS = (["vllm-default"] + [f"vllm-watermark={w:g}" for w in WATERMARKS] +
                 [DEFAULT_CONFIG, "peak"])


def simulate(config: BenchConfig, workload: list[BenchRequest], engine: BenchEngine) -> dict:
    """The same requests, all queued at once, through the simulator's native engine
    model (cpu-tiny step times): its steps, preemptions, recomputed tokens, pauses."""
    from kvadmit.simulate import get_preset, run_native
    cfg, shape = config.sim(engine.sim_shape())
    raw = run_native(as_burst(workload), cfg, shape, get_preset("cpu-tiny"))
    t = raw.totals
    return {"config": config.label, "steps": t.steps, "preemptions": t.preemptions,
            "recomputed_tokens": t.recomputed_tokens,
            "paused": raw.extra["core"].get("paused", 0), "makespan_s": t.makespan_s,
            "finished": t.finished, "rejected": t.rejected}


def default_goals(rows: list[dict], sims: dict[str, dict], honest: bool) -> dict | None:
    """The scorecard's goals for the default config ({}) on this workload, met or not,
    on the real engine and in the simulator. The real engine's time goal is on its
    modelled time (its own steps priced by the CPU step-time fit): wall time on a shared
    CPU is too noisy for it."""
    from kvadmit.simulate import scorecard
    by = {r["config"]: r for r in rows}
    if not (DEFAULT_CONFIG in by and "vllm-default" in by and best_watermark(rows)):
        return None

    def cells(src):
        return {(scorecard.DEFAULT_ROW if n == DEFAULT_CONFIG else n): c for n, c in src.items()}
    loose = by["vllm-default"]["preemptions"] == 0
    real = scorecard.goals(cells({n: {**r, "makespan_s": r["modelled_s"]} for n, r in by.items()}),
                           honest, loose)
    return {"real": real, "sim": scorecard.goals(cells(sims), honest, loose)}


def sim_vs_real(rows: list[dict], sims: dict[str, dict]) -> dict:
    """Per config: the real and simulated ratios against vllm-default and whether the
    verdict (fewer or more steps; fewer or more preemptions) is the same."""
    by = {r["config"]: r for r in rows}
    out = {}
    for name, r in by.items():
        s = sims[name]
        cell = {"steps": [r["steps"], s["steps"]], "preemptions": [r["preemptions"], s["preemptions"]]}
        if "vllm-default" in by:
            rr, sr = ratios(r, by["vllm-default"]), ratios(s, sims["vllm-default"])
            cell["steps_vs_vllm_default"] = [rr["steps"], sr["steps"]]
            cell["preemptions_vs_vllm_default"] = [rr["preemptions"], sr["preemptions"]]
            cell["same_verdict"] = (_side(rr["steps"]) == _side(sr["steps"]) and
                                    _side(rr["preemptions"]) == _side(sr["preemptions"]))
        out[name] = cell
    return out


def _side(ratio: float, tol: float = 0.01) -> int:
    """-1 below, 0 within tol of, +1 above 1.0."""
    return 0 if abs(ratio - 1.0) <= tol else (1 if ratio > 1.0 else -1)


def run_suite(args, model_dir: str, configs: list[BenchConfig]) -> dict:
    cases = [c for c in SUITE if not args.cases or c.name in args.cases]
    out = {"command": " ".join(["kvadmit", "bench", "vllm", *args.argv]),
           "configs": {c.label: c.doc for c in configs}, "order": args.order, "seed": args.seed,
           "warmup_requests": args.warmup, "workloads": []}
    t_all = time.perf_counter()
    warmed = False
    for k, case in enumerate(cases, 1):
        n = args.requests or case.requests
        workload, source = build_workload(case.kind, n, case.engine.max_model_len,
                                          case.max_tokens, case.caps, case.stop_early, args.trace)
        if not warmed:
            warm_up(model_dir, workload, case.engine, case.stop_early, args.warmup)
            warmed = True
        say(f"\n== {case.name} ({k}/{len(cases)}): {case.about}\n   {source}; pool "
            f"{case.engine.num_blocks} blocks x {case.engine.block_size}; max_model_len "
            f"{case.engine.max_model_len}", flush=True)
        rows = run_configs(configs, model_dir, workload, case.engine, case.stop_early, args.order,
                           args.seed + k, tag=f"{case.name} ")
        sims = {c.label: simulate(c, workload, case.engine) for c in configs}
        print_table(rows, sims)
        entry = {"name": case.name, "about": case.about, "workload": source, "requests": n,
                 "engine": dataclasses.asdict(case.engine), "rows": rows,
                 "sim": sims, "sim_vs_real": sim_vs_real(rows, sims)}
        by = {r["config"]: r for r in rows}
        if "vllm-default" in by:
            entry["vs_vllm_default"] = {r["config"]: ratios(r, by["vllm-default"]) for r in rows}
        wm = best_watermark(rows)
        if wm:
            entry["best_watermark"] = wm
            entry["vs_best_watermark"] = {r["config"]: ratios(r, by[wm]) for r in rows}
        goals = default_goals(rows, sims, honest=case.caps == "real" or not case.stop_early)
        if goals:
            entry["goals"] = goals
            missed = [g for g, ok in goals["real"].items() if not ok]
            differ = [g for g, ok in goals["real"].items() if goals["sim"][g] != ok]
            say(f"{DEFAULT_CONFIG} goals on the real engine: "
                f"{'all met' if not missed else 'missed ' + ', '.join(missed)}; the simulator "
                f"{'agrees' if not differ else 'differs on ' + ', '.join(differ)}", flush=True)
        agree = [name for name, c in entry["sim_vs_real"].items() if c.get("same_verdict") is False]
        say(f"simulator vs real: steps {_sim_err(rows, sims):.1%} apart at most; verdicts vs "
            f"vllm-default {'all the same' if not agree else 'differ for ' + ', '.join(agree)}",
            flush=True)
        if not args.keep_tokens:
            for r in rows:
                r.pop("tokens")
        out["workloads"].append(entry)
    out["wall_s"] = time.perf_counter() - t_all
    say(f"\nsuite: {len(cases)} workloads x {len(configs)} configs in {out['wall_s']:.0f} s",
        flush=True)
    return out


def _sim_err(rows: list[dict], sims: dict[str, dict]) -> float:
    return max(abs(sims[r["config"]]["steps"] - r["steps"]) / r["steps"] for r in rows)
