"""Retractions and steps of kvadmit's default `{}` against stock SGLang 0.5.23's own
admission rule, on SGLang's real scheduling classes (tests/sglang/sglang_harness.py),
over the retraction test's workloads and more seeds and families outside it.

    python bench/sglang_retractions.py               # all 46 workloads (about 2 min)
    python bench/sglang_retractions.py --only test   # the test's 22

Prints a line per workload (R: more retractions than stock, S: more steps) and
saves bench/results/sglang_retractions.json. Needs SGLang 0.5.23 (its scheduling
modules run on the CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

from _common import RESULTS

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "sglang"))

from conftest import install_kvadmit_hooks  # noqa: E402
from sglang_workloads import CASES, FAMILIES, KNOWN_FAILING, plan_for, run  # noqa: E402

from kvadmit import AdmissionConfig  # noqa: E402

TEST = CASES + KNOWN_FAILING   # the test's workloads
# Other families, pools and seeds
OTHER = [("fixed", 1, 1500), ("fixed", 2, 2000), ("pareto", 1, 1500), ("drift", 1, 2000),
         ("bigprompt_uni", 1, 1500), ("honest", 1, 1500), ("uniform", 3, 1000),
         ("bimodal", 3, 3000)] + [
    (k, s, p) for k in ("uniform", "bimodal", "narrow", "slack", "twopoint", "geometric",
                        "uniwide", "fixed")
    for s, p in ((4, 1500), (5, 2000))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("test", "other"), help="one group of workloads")
    ap.add_argument("--out", default=str(RESULTS / "sglang_retractions.json"))
    args = ap.parse_args(argv)
    cases = {"test": TEST, "other": OTHER}.get(args.only, TEST + OTHER)
    install_kvadmit_hooks()
    from kvadmit.sglang import plugin
    plugin.verify(plugin.engine_hooks())     # else both rows would be stock SGLang
    rows, t0 = [], time.perf_counter()
    for i, (kind, seed, pool) in enumerate(cases, 1):
        stock = run(None, kind, seed, pool)
        ours = run(AdmissionConfig.from_dict({}), kind, seed, pool)
        n = sum(len(ws) for ws in plan_for(kind, seed).values())
        if stock[2] != n or ours[2] != n:
            raise SystemExit(f"{kind}/{seed}/{pool}: finished {stock[2]} (stock) and {ours[2]} "
                             f"(kvadmit) of {n} requests")
        flag = ("R" if ours[0] > stock[0] else " ") + ("S" if ours[1] > stock[1] else " ")
        rows.append({"kind": kind, "family": FAMILIES[kind], "seed": seed, "pool": pool,
                     "stock_retracted": stock[0], "stock_steps": stock[1],
                     "kvadmit_retracted": ours[0], "kvadmit_steps": ours[1],
                     "finished": [stock[2], ours[2]]})
        print(f"[{i}/{len(cases)}] {flag} {kind}/{seed}/{pool}: stock {stock[0]} retracted in "
              f"{stock[1]} steps, kvadmit {{}} {ours[0]} in {ours[1]} "
              f"({ours[1] / stock[1]:.3f}x)", flush=True)
    more_r = sum(r["kvadmit_retracted"] > r["stock_retracted"] for r in rows)
    more_s = sum(r["kvadmit_steps"] > r["stock_steps"] for r in rows)
    geo = math.exp(sum(math.log(r["kvadmit_steps"] / r["stock_steps"]) for r in rows) / len(rows))
    print(f"{len(rows)} workloads: more retractions than stock on {more_r}, more steps on "
          f"{more_s}; steps / stock geomean {geo:.3f} ({time.perf_counter() - t0:.0f} s)")
    pathlib.Path(args.out).write_text(json.dumps({
        "command": "python bench/sglang_retractions.py" + (f" --only {args.only}" if args.only else ""),
        "rows": rows, "more_retractions": more_r, "more_steps": more_s,
        "steps_geomean": geo}, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
