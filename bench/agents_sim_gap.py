"""How much of the gap to a pool that never evicts kvadmit closes on agent sessions,
in the simulator's GPU presets (issue 55, item 3).

For each preset and session start rate, agents as `kvadmit simulate --synthetic
agents --turns 10 --tool-wait 5 --prefix-caching --slo-ttft 5` would draw them
(600 sessions, seeds 1-3), run:
- vLLM's default (it ignores kv_hold_s),
- kvadmit's default, clients sending nothing,
- kvadmit's default, clients sending kv_hold_s 0 on a session's last turn ("done"),
- that, with history-aware admission as today's knobs approximate it (RETURNING_FIRST),
- the bound: vLLM's default on a pool that never evicts (BOUND_POOL_FACTOR x the preset's).
Each row gives goodput (TTFT <= 5 s and TPOT <= 100 ms), TTFT p99, prefix hit rate, the
longest TTFT, and the share of vLLM's gap to the bound each kvadmit row closes
((x - vLLM) / (bound - vLLM); none where the gap is under GAP_FLOOR). `working set`
is the 95th percentile over time of the live sessions' contexts (each started session,
until its last turn ends in the bound run, at its latest turn's prompt and output)
over the preset's pool: where it passes ~1, histories no longer fit.

    .venv/bin/python bench/agents_sim_gap.py     # prints, saves bench/results/agents_sim_gap.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import save
from kvadmit.bench.agents_report import gap_share
from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.metrics import Slo, summarize
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.run import run_policy
from kvadmit.simulate.steptime import get_preset
from kvadmit.simulate.workload import agent_sessions

RATES = {"h100-8b": (0.75, 1.5, 2.25, 3.0), "h100x4-70b": (0.5, 0.9, 1.2, 1.5)}
SEEDS = (1, 2, 3)
BOUND_POOL_FACTOR = 15
GAP_FLOOR = {"goodput": 0.01, "ttft_p99_s": 0.1, "prefix_hit_rate": 0.01}
# (label, clients' kv_hold_s, pool factor, policy, first turns' priority); the last
# kvadmit row is history-aware admission as today's knobs approximate it: a session's
# first request asks for priority 1 (lowering one's own priority needs no trust), the
# queue serves returning turns first, and admission keeps learned-length room (adaptive)
RETURNING_FIRST = '{"policy": "adaptive", "queue_order": "priority"}'
ROWS = (("vllm-default", "none", 1, "vllm-default", 0), ("kvadmit", "none", 1, "auto", 0),
        ("kvadmit+done", "done", 1, "auto", 0),
        ("+returning", "done", 1, f"returning={RETURNING_FIRST}", 1),
        ("bound", "none", BOUND_POOL_FACTOR, "vllm-default", 0))
KVADMIT_ROWS = ("kvadmit", "kvadmit+done", "+returning")


def working_set(w, raw, pool_tokens: int) -> float:
    """95th percentile over time of the live sessions' contexts, over the pool: a
    session counts from its first turn's arrival to its last turn's end, at the
    prompt and output of its latest arrived turn."""
    pr = raw.per_request
    events, last = [], {}
    for i, s in enumerate(w.session):
        total = w.prompt_tokens[i] + w.output_tokens[i]
        p = w.parent[i]
        events.append((pr["arrival_s"][i], total - (w.prompt_tokens[p] + w.output_tokens[p] if p >= 0 else 0)))
        if pr["finish_s"][i] >= last.get(s, (-1.0, 0))[0]:
            last[s] = (pr["finish_s"][i], total)
    events += [(t, -total) for t, total in last.values()]
    events.sort()
    live, samples = 0, []
    for _, d in events:
        live += d
        samples.append(live)
    samples.sort()
    return samples[int(0.95 * (len(samples) - 1))] / pool_tokens


def run_cell(preset: str, rate: float, seed: int) -> dict:
    step = get_preset(preset)
    slo = Slo(5.0, 0.1)
    out = {}
    for label, hold, factor, policy, first_priority in ROWS:
        shape = EngineShape(num_blocks=step.num_blocks * factor, block_size=step.block_size,
                            max_model_len=step.max_model_len, max_num_seqs=1024,
                            max_num_batched_tokens=8192, prefix_caching=True)
        w = agent_sessions(600, rate, seed=seed, max_tokens_cap=2048, max_model_len=step.max_model_len,
                           block_tokens=step.block_size, turns_mean=10, tool_wait_mean_s=5.0,
                           kv_hold=hold)
        if first_priority:
            w.priority = [first_priority if p < 0 else 0 for p in w.parent]
        spec = parse_policy(policy)
        raw = run_policy(w, spec, "native", shape, step, AdmissionConfig())
        m = summarize(raw.per_request, raw.totals, slo)
        ttft = [f - a for a, f in zip(raw.per_request["arrival_s"], raw.per_request["first_token_s"])
                if f >= 0]
        out[label] = {"goodput": m["goodput"], "ttft_p99_s": m["ttft_p99_s"],
                      "tpot_p99_s": m["tpot_p99_s"],
                      "prefix_hit_rate": m["prefix_hit_rate"], "longest_ttft_s": max(ttft),
                      "preemptions": m["preemptions"],
                      "lost": len(w) - raw.totals.finished - raw.totals.rejected}
        if out[label]["lost"]:
            raise SystemExit(f"{preset} rate {rate} seed {seed} {label}: "
                             f"{out[label]['lost']} turns neither finished nor refused")
        if label == "bound":
            out["working_set"] = working_set(w, raw, step.num_blocks * step.block_size)
    for label in KVADMIT_ROWS:
        out[label]["gap_closed"] = {k: gap_share(out[label][k], out["vllm-default"][k],
                                                 out["bound"][k], floor)
                                    for k, floor in GAP_FLOOR.items()}
    return out


def _pct(x):
    return "   -" if x is None else f"{100 * x:4.0f}"


def print_summary(cells: list[dict]) -> None:
    """Per preset and rate, over the seeds: each config's goodput, TTFT p99, hit rate and
    longest TTFT (medians; the longest TTFT's worst), and the share of the gap closed
    (median over the seeds where a gap exists, with their count)."""
    print("\nmedian over seeds | gap closed: median % (seeds with a gap)")
    keys = sorted({(c["preset"], c["rate"]) for c in cells}, key=lambda k: (k[0], k[1]))
    for preset, rate in keys:
        cs = [c for c in cells if (c["preset"], c["rate"]) == (preset, rate)]
        wset = statistics.median(c["working_set"] for c in cs)
        for label, *_ in ROWS:
            rs = [c[label] for c in cs]
            line = (f"{preset:11} {rate:5.2f} wset {wset:4.2f}  {label:13} "
                    f"{100 * statistics.median(r['goodput'] for r in rs):6.1f}% "
                    f"{statistics.median(r['ttft_p99_s'] for r in rs):7.2f} s "
                    f"{100 * statistics.median(r['prefix_hit_rate'] for r in rs):5.1f}% "
                    f"max {max(r['longest_ttft_s'] for r in rs):6.1f} s")
            if label in KVADMIT_ROWS:
                for k in GAP_FLOOR:
                    g = [r["gap_closed"][k] for r in rs if r["gap_closed"][k] is not None]
                    line += f"  {k.split('_')[0]} " + (f"{100 * statistics.median(g):4.0f} ({len(g)})"
                                                       if g else "   - (0)")
            print(line)


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(RATES))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/agents_sim_gap.json")
    args = ap.parse_args(argv)
    cells = []
    print(f"{'preset':11} {'rate':>5} {'seed':>4} {'wset':>5}  {'config':13} {'goodput':>7} "
          f"{'TTFTp99':>8} {'hit':>5} {'maxTTFT':>8}  gap closed %: goodput TTFTp99 hit")
    for preset in args.presets:
        for rate in RATES[preset]:
            for seed in args.seeds:
                c = run_cell(preset, rate, seed)
                cells.append({"preset": preset, "rate": rate, "seed": seed, **c})
                for label, *_ in ROWS:
                    r = c[label]
                    g = r.get("gap_closed", {})
                    print(f"{preset:11} {rate:5.2f} {seed:4d} {c['working_set']:5.2f}  {label:13} "
                          f"{100 * r['goodput']:6.1f}% {r['ttft_p99_s']:8.2f} {100 * r['prefix_hit_rate']:4.1f}% "
                          f"{r['longest_ttft_s']:8.1f}  " + (" ".join(_pct(g.get(k)) for k in GAP_FLOOR)
                                                            if g else ""))
    print_summary(cells)
    if not args.no_save:
        print(f"saved {save('agents_sim_gap', {'wall_s': round(time.perf_counter() - t0, 1), 'cells': cells})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
