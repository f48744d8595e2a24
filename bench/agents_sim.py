"""Issue 43's agent workload in the simulator, through vLLM's real scheduler
in-process on a virtual clock (`kvadmit.simulate.vllm_engine.run_vllm`), beside
vLLM 0.34's `cache_aware_admission_window` (which has no CPU build to serve with).

The workload is the real-engine run's shape (`kvadmit bench agents`,
docs/slo-agents.md "Measured on vLLM: agent sessions over HTTP"): N sessions that
start together, T turns each; turn 1's prompt is a shared system prefix plus the
session's task, each later turn's prompt the whole context so far (every earlier
prompt and output) plus a tool output, arriving an exponential tool wait after the
previous turn is done. Prefix-block ids (one per 32-token block) make the shared
prefix and each session's history hit vLLM's prefix cache where the real tokens
would. The engine: a pool of 64 usable blocks x 32 tokens (vLLM is given 65, one
is its null block), max_model_len 1024, max_num_seqs 128, max_num_batched_tokens
2048, prefix caching on; step times from the CPU fit (`steptime.CPU_TINY`).

Configs: vLLM's own scheduler (default; max_num_seqs 8; with
cache_aware_admission_window W and its threshold, vLLM >= 0.34 only), kvadmit's
default `{}` and `{"agent_window": true}` (kvadmit's adapter turns 0.34's window
off when kvadmit schedules). Optionally the native engine model for the kvadmit
rows (`--native`).

    VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= .venv034/bin/python bench/agents_sim.py

Columns: makespan (virtual s, first arrival to the last step's end); output tok/s
over it; prefix hit rate = vLLM's prefix-cache hits / queries at every admission
(re-admissions after a preemption included; the native engine counts its own);
preemptions; recomputed prompt tokens = prompt tokens prefilled (first time or
again) minus what an unbounded prefix cache would prefill (the shared prefix once,
then per turn what lies past the last full block of the session's earlier KV);
TTFT p50/p99 per turn (first token - arrival); longest wait = the largest TTFT;
turns done (finished, of all).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _common import save  # noqa: E402

from kvadmit.bench.agents import AgentEngine, AgentWorkload, ideal_prefill  # noqa: E402
from kvadmit.config import AdmissionConfig  # noqa: E402
from kvadmit.simulate.engine import EngineShape, run_native  # noqa: E402
from kvadmit.simulate.steptime import CPU_TINY  # noqa: E402
from kvadmit.simulate.workload import Workload, append_turn, session_workload  # noqa: E402

# The real-engine bench's workload and engine (kvadmit bench agents), one definition
WORKLOAD, ENGINE = AgentWorkload(), AgentEngine()
BLOCK = ENGINE.block_size


def agent_workload(sessions: int, turns: int, prefix: int, task: int, gen: int, tool: int,
                   tool_wait_s: float, seed: int) -> tuple[Workload, int]:
    """The workload and the prompt tokens an unbounded prefix cache would prefill."""
    if prefix % BLOCK:
        raise ValueError(f"prefix={prefix}: must be a multiple of {BLOCK}")
    rng = random.Random(seed)
    w = session_workload("agents-issue43", BLOCK)
    next_id = 1 << 40                       # session content ids; the prefix's are 0..
    ideal = prefix                          # the shared prefix, once
    for s in range(sessions):
        ids = list(range(prefix // BLOCK))
        context, prev = prefix, -1
        for k in range(turns):
            new = task if k == 0 else tool
            prompt = context + new
            total = prompt + gen
            ideal += ideal_prefill(prompt, prefix if k == 0 else context, BLOCK)
            delay = 0.0 if prev < 0 else rng.expovariate(1.0 / tool_wait_s)
            next_id = append_turn(w, ids, next_id, 0.0, prompt, gen, gen, prev, delay, s)
            prev = len(w.arrival_s) - 1
            context = total
    w.description = (f"agents: {sessions} sessions x {turns} turns start together, {prefix}-token "
                     f"shared prefix, {task}-token task, {gen} generated a turn, {tool}-token tool "
                     f"output after an exponential wait of mean {tool_wait_s:g} s, seed {seed}")
    return w, ideal


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def summarize(name: str, engine: str, run, ideal: int, n: int, wall: float) -> dict:
    t, pr = run.totals, run.per_request
    ttft = [f - a for a, f in zip(pr["arrival_s"], pr["first_token_s"]) if a >= 0 and f >= 0]
    lat = [f - a for a, f, r in zip(pr["arrival_s"], pr["finish_s"], pr["rejected"])
           if a >= 0 and f >= 0 and r is None]
    return {
        "config": name, "engine": engine,
        "makespan_s": t.makespan_s,
        "output_tok_s": t.output_tokens / t.makespan_s if t.makespan_s > 0 else 0.0,
        "prefix_hit_rate": t.prefix_hit_tokens / t.prefix_query_tokens if t.prefix_query_tokens else None,
        "prefix_hit_tokens": t.prefix_hit_tokens, "prefix_query_tokens": t.prefix_query_tokens,
        "preemptions": t.preemptions,
        "prefill_tokens": t.prefill_tokens,
        "recomputed_prompt_tokens": t.prefill_tokens - ideal,
        "recomputed_after_preemption_tokens": t.recomputed_tokens,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "latency_p50_s": pct(lat, 0.5), "latency_p99_s": pct(lat, 0.99),
        "longest_wait_s": max(ttft) if ttft else None,
        "kv_util_mean": t.kv_util_mean, "steps": t.steps,
        "finished": t.finished, "rejected": t.rejected, "turns": n,
        "wall_s": wall,
        # kvadmit's agent window at the end (W, sessions in it, times W changed)
        "agent_window": (run.extra.get("core") or {}).get("agent_window"),
    }


WINDOW_COUNTS = {"calls": 0, "engaged": 0, "reordered": 0}


def count_window_reorders() -> bool:
    """Counts, without changing it, what vLLM 0.34's cache-aware window does each
    step (`Scheduler._reorder_waiting_by_cached_prefix`): calls (the window is on),
    engaged (>= 2 waiting and KV usage at or over the threshold), reordered (the
    waiting queue's order changed). False where vLLM has no such method."""
    import itertools

    from vllm.v1.core.sched.scheduler import Scheduler
    orig = getattr(Scheduler, "_reorder_waiting_by_cached_prefix", None)
    if orig is None:
        return False

    def counted(self):
        WINDOW_COUNTS["calls"] += 1
        if len(self.waiting) >= 2 and self.kv_cache_manager.usage >= self.cache_aware_threshold:
            WINDOW_COUNTS["engaged"] += 1
        before = [r.request_id for r in itertools.islice(self.waiting, self.cache_aware_window)]
        orig(self)
        after = [r.request_id for r in itertools.islice(self.waiting, self.cache_aware_window)]
        if before != after:
            WINDOW_COUNTS["reordered"] += 1

    Scheduler._reorder_waiting_by_cached_prefix = counted
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    wl = WORKLOAD
    ap.add_argument("--sessions", type=int, default=wl.sessions)
    ap.add_argument("--turns", type=int, default=wl.turns)
    ap.add_argument("--prefix", type=int, default=wl.system_tokens)
    ap.add_argument("--task", type=int, default=wl.task_tokens)
    ap.add_argument("--gen", type=int, default=wl.output_tokens)
    ap.add_argument("--tool", type=int, default=wl.tool_tokens)
    ap.add_argument("--tool-wait", type=float, default=wl.tool_wait_s)
    ap.add_argument("--blocks", type=int, default=ENGINE.num_blocks - 1,
                    help="usable KV blocks (vLLM gets one more)")
    ap.add_argument("--seed", type=int, default=wl.seed)
    ap.add_argument("--max-model-len", type=int, default=ENGINE.max_model_len)
    ap.add_argument("--window", type=int, nargs="*", default=[16, 128],
                    help="cache_aware_admission_window values, one vLLM 0.34 row each")
    ap.add_argument("--threshold", type=float, default=None,
                    help="cache_aware_admission_threshold (default: vLLM's own, 0.5)")
    ap.add_argument("--native", action="store_true", help="also the kvadmit rows on the native engine model")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                    help="another kvadmit config row (e.g. a probe of a window setting)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="results name (default agents_sim_<vllm version>)")
    args = ap.parse_args()

    import vllm

    from kvadmit.simulate.vllm_engine import run_vllm
    from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama

    version = vllm.__version__
    model = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    w, ideal = agent_workload(args.sessions, args.turns, args.prefix, args.task, args.gen,
                              args.tool, args.tool_wait, args.seed)
    shape = EngineShape(num_blocks=args.blocks, block_size=BLOCK,
                        max_model_len=args.max_model_len, max_num_seqs=ENGINE.max_num_seqs,
                        max_num_batched_tokens=ENGINE.max_num_batched_tokens, prefix_caching=True)
    import dataclasses

    from vllm.config import SchedulerConfig
    has_window = "cache_aware_admission_window" in {f.name for f in dataclasses.fields(SchedulerConfig)}
    # (name, kvadmit config or None: vLLM's own scheduler, shape, vLLM engine_args)
    configs = [("vllm-default", None, shape, {}),
               ("vllm-seqs=8", None, EngineShape(**{**shape.__dict__, "max_num_seqs": 8}), {})]
    window_args = []
    for win in args.window:
        wa = {"cache_aware_admission_window": win}
        if args.threshold is not None:
            wa["cache_aware_admission_threshold"] = args.threshold
        window_args.append(wa)
        if has_window:
            configs.append((f"vllm-cache-window={win}"
                            + (f",threshold={args.threshold:g}" if args.threshold is not None else ""),
                            None, shape, wa))
    if args.window and not has_window:
        print(f"vLLM {version} has no cache_aware_admission_window: no window rows", flush=True)
    configs += [("kvadmit-default", AdmissionConfig.from_dict({}), shape, {}),
                ("kvadmit-window", AdmissionConfig.from_dict({"agent_window": True}), shape, {})]
    for spec in args.extra:
        xname, _, js = spec.partition("=")
        configs.append((xname, AdmissionConfig.from_dict(json.loads(js)), shape, {}))

    counting = count_window_reorders()
    print(f"vLLM {version}; {w.description}; {len(w)} turns; ideal prefill {ideal} tokens", flush=True)
    rows = []
    for name, cfg, shp, eargs in configs:
        WINDOW_COUNTS.update(calls=0, engaged=0, reordered=0)
        t0 = time.perf_counter()
        run = run_vllm(w, cfg, shp, CPU_TINY, model, engine_args=eargs or None,
                       progress=lambda d, n: print(f"  {name}: {d}/{n} turns done", flush=True))
        if eargs:
            run.extra["engine_args"] = eargs
        row = summarize(name, "vllm", run, ideal, len(w), time.perf_counter() - t0)
        if counting:
            row["cache_aware_window_steps"] = dict(WINDOW_COUNTS)
        rows.append(row)
        print(f"{name} (vllm {version}): makespan {row['makespan_s']:.1f} s, hit "
              f"{row['prefix_hit_rate']:.2f}, preemptions {row['preemptions']}, longest wait "
              f"{row['longest_wait_s']:.1f} s, wall {row['wall_s']:.1f} s"
              + (f", window steps {row['cache_aware_window_steps']}" if counting and eargs else ""),
              flush=True)
    if args.native:
        for name, cfg, shp, _ in configs:
            if cfg is None:
                continue
            t0 = time.perf_counter()
            run = run_native(w, cfg, shp, CPU_TINY)
            row = summarize(name, "native", run, ideal, len(w), time.perf_counter() - t0)
            rows.append(row)
            print(f"{name} (native): makespan {row['makespan_s']:.1f} s, hit "
                  f"{row['prefix_hit_rate']:.2f}, wall {row['wall_s']:.1f} s", flush=True)

    print()
    print("| config | engine | makespan s | output tok/s | prefix hit rate | preemptions | "
          "recomputed prompt tokens | TTFT p50/p99 s | turn latency p50/p99 s | longest wait s | turns done |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eng = f"vLLM {version}" if r["engine"] == "vllm" else "native model"
        print(f"| {r['config']} | {eng} | {r['makespan_s']:.1f} | {r['output_tok_s']:.0f} | "
              f"{r['prefix_hit_rate']:.2f} | {r['preemptions']} | {r['recomputed_prompt_tokens']} | "
              f"{r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} | {r['latency_p50_s']:.2f}/"
              f"{r['latency_p99_s']:.2f} | {r['longest_wait_s']:.1f} | {r['finished']}/{r['turns']} |")
    name = args.out or f"agents_sim_{version.replace('.', '')[:3]}"
    path = save(name, {"vllm_version": version, "workload": w.description, "turns": len(w),
                       "ideal_prefill_tokens": ideal,
                       "shape": {**shape.__dict__}, "step_time": CPU_TINY.name,
                       "window_args": window_args, "has_cache_aware_window": has_window,
                       "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
