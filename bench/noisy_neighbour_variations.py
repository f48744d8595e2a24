"""The noisy neighbour's variations (docs/flows.md, "Variations"): bench/noisy_neighbour.py
on twelve variations of its workload, six seeds each. For each it prints the flows
rows (kvadmit default + flows, under the default head_of_line bypass and strict):
the interactive goodput vs alone and the pool utilisation vs batch-only, mean and per
seed, a figure below the goals' 95% marked *.

    python bench/noisy_neighbour_variations.py              # about 5 min on the 2-core dev VM
    python bench/noisy_neighbour_variations.py --seeds 0 1 2

Saves bench/results/noisy_neighbour_variations.json (every variation's rows and seeds).
"""
from __future__ import annotations

import argparse
import sys
import time

import noisy_neighbour
from _common import save

VARIATIONS = (
    ("sparse small interactive requests", "--interactive-lengths 64 32 --interactive-load 0.1"),
    ("sparse, interactive prompts 128", "--interactive-lengths 128 32 --interactive-load 0.05"),
    ("base", ""),
    ("interactive at 0.15 x capacity", "--interactive-load 0.15"),
    ("interactive at 0.5 x capacity", "--interactive-load 0.5"),
    ("batch prompts 1500, outputs 250", "--batch-lengths 1500 250"),
    ("interactive prompts 2000, outputs 300", "--interactive-lengths 2000 300"),
    ("pool 4096 blocks", "--num-blocks 4096"),
    ("batch offers 3x its share", "--batch-offer 3"),
    ("weights 2:1 (interactive 2)", "--weights 2 1"),
    ("weights 1:3 (batch 3)", "--weights 1 3"),
    ("weights 1:3, interactive at 0.15", "--weights 1 3 --interactive-load 0.15"),
)
GOAL = 0.95


def flows_rows(rows) -> dict:
    """{"bypass": row, "strict": row} of one run's rows (the flows runs under kvadmit's
    default policy)."""
    out = {}
    for r in rows:
        if r["run"].startswith("flows, weight") and "vLLM" not in r["run"]:
            out["strict" if "strict" in r["run"] else "bypass"] = r
    return out


def cell(row) -> str:
    g, u = row["goodput_vs_alone"], row["util_vs_batch_only"]
    return f"{g:.1%}{'*' if g < GOAL else ''} / {u:.1%}{'*' if u < GOAL else ''}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    args = ap.parse_args(argv)
    seeds = [str(s) for s in args.seeds]
    results, t0 = [], time.perf_counter()
    for i, (name, extra) in enumerate(VARIATIONS, 1):
        print(f"[{i}/{len(VARIATIONS)}] {name}: python bench/noisy_neighbour.py {extra} "
              f"--seeds {' '.join(seeds)}", flush=True)
        run_args = noisy_neighbour.parser().parse_args(extra.split() + ["--seeds", *seeds])
        payload = noisy_neighbour.measure(run_args)
        results.append({"variation": name, "args": extra, "mean": payload["mean"],
                        "seeds": payload["seeds"]})
    print(f"\nflows (kvadmit default + flows): interactive goodput vs alone / pool utilisation "
          f"vs batch-only, mean over seeds {' '.join(seeds)} (* below {GOAL:.0%}); "
          f"{time.perf_counter() - t0:.0f} s")
    for res in results:
        mean = flows_rows(res["mean"])
        per = [flows_rows(s["rows"]) for s in res["seeds"]]
        res["flows"] = {k: {"mean": [mean[k]["goodput_vs_alone"], mean[k]["util_vs_batch_only"]],
                            "per_seed": [[p[k]["goodput_vs_alone"], p[k]["util_vs_batch_only"]]
                                         for p in per]} for k in mean}
        print(f"  {res['variation']:40s} bypass {cell(mean['bypass']):18s} strict "
              f"{cell(mean['strict']):18s} per seed (bypass): "
              + ", ".join(f"{p['bypass']['goodput_vs_alone']:.1%}/{p['bypass']['util_vs_batch_only']:.1%}"
                          for p in per))
    path = save("noisy_neighbour_variations", {"seeds": args.seeds, "variations": results})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
