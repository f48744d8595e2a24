"""Retractions and steps of kvadmit's default `{}` against stock SGLang 0.5.23's own
admission rule, on SGLang's real scheduling classes (tests/sglang/sglang_harness.py),
over the retraction test's workloads and more seeds and families outside it.

    python bench/sglang_retractions.py               # all 69 workloads (about 5-8 min)
    python bench/sglang_retractions.py --only test   # the test's 25

Stock SGLang runs at --schedule-conservativeness 1 (its default) and at each of
--conservativeness (default 0.5 and 1.43: SGLang's advice for frequent retractions is
a larger value, and above 1/0.7 its ratio saturates). Prints a line per workload (R:
more retractions than stock at 1, S: more steps) and saves
bench/results/sglang_retractions.json, with a summary against each setting and
against stock's best: per workload, its fewest steps among the settings that retract
no more than kvadmit does. Needs SGLang 0.5.23 (its scheduling
modules run on the CPU).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

from _common import save

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "sglang"))

from conftest import install_kvadmit_hooks  # noqa: E402
from sglang_workloads import CASES, FAMILIES, STEP_TRADE, plan_for, run  # noqa: E402

from kvadmit import AdmissionConfig  # noqa: E402

TEST = CASES + STEP_TRADE   # the test's workloads
# Other families, pools and seeds (those the test runs are left out: run once)
OTHER = [c for c in [("fixed", 1, 1500), ("fixed", 2, 2000), ("pareto", 1, 1500), ("drift", 1, 2000),
         ("bigprompt_uni", 1, 1500), ("honest", 1, 1500), ("uniform", 3, 1000),
         ("bimodal", 3, 3000)] + [
    (k, s, p) for k in ("uniform", "bimodal", "narrow", "slack", "twopoint", "geometric",
                        "uniwide", "fixed", "mixcap")
    for s, p in ((4, 1500), (5, 2000))] + [
    # larger pools, where more requests run at once
    (k, s, p) for p in (3000, 4000) for k in ("uniform", "bimodal", "uniwide", "slack", "narrow")
    for s in (1, 2)] if c not in TEST]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("test", "other"), help="one group of workloads")
    ap.add_argument("--conservativeness", type=float, nargs="*", default=[0.5, 1.43],
                    help="stock SGLang's --schedule-conservativeness values beside 1")
    ap.add_argument("--out", default="sglang_retractions", help="bench/results/<out>.json")
    args = ap.parse_args(argv)
    cases = {"test": TEST, "other": OTHER}.get(args.only, TEST + OTHER)
    install_kvadmit_hooks()
    from kvadmit.sglang import plugin
    plugin.verify(plugin.engine_hooks())     # else both rows would be stock SGLang
    settings = [1.0] + sorted({c for c in args.conservativeness if c != 1.0})
    rows, t0 = [], time.perf_counter()
    for i, (kind, seed, pool) in enumerate(cases, 1):
        n = sum(len(ws) for ws in plan_for(kind, seed).values())
        ours = run(AdmissionConfig.from_dict({}), kind, seed, pool)
        by_c = {c: run(None, kind, seed, pool, c) for c in settings}
        for who, r in [("kvadmit", ours)] + [(f"stock at {c}", r) for c, r in by_c.items()]:
            if r[2] != n:
                raise SystemExit(f"{kind}/{seed}/{pool}: {who} finished {r[2]} of {n} requests")
        stock = by_c[1.0]
        best = min((r[1] for r in by_c.values() if r[0] <= ours[0]), default=None)
        flag = ("R" if ours[0] > stock[0] else " ") + ("S" if ours[1] > stock[1] else " ")
        rows.append({"kind": kind, "family": FAMILIES[kind], "seed": seed, "pool": pool,
                     "stock_retracted": stock[0], "stock_steps": stock[1],
                     "kvadmit_retracted": ours[0], "kvadmit_steps": ours[1],
                     "stock_by_conservativeness": {str(c): list(r[:2]) for c, r in by_c.items()},
                     "stock_best_steps": best, "finished": [stock[2], ours[2]]})
        others = ", ".join(f"at {c}: {r[0]} in {r[1]}" for c, r in by_c.items() if c != 1.0)
        print(f"[{i}/{len(cases)}] {flag} {kind}/{seed}/{pool}: stock {stock[0]} retracted in "
              f"{stock[1]} steps ({others}), kvadmit {{}} {ours[0]} in {ours[1]} "
              f"({ours[1] / stock[1]:.3f}x)", flush=True)

    def geomean(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    summary = {}
    for c in settings:
        stock_at = [r["stock_by_conservativeness"][str(c)] for r in rows]   # (retracted, steps)
        s = summary[str(c)] = {
            "more_retractions": sum(r["kvadmit_retracted"] > st[0] for r, st in zip(rows, stock_at)),
            "more_steps": sum(r["kvadmit_steps"] > st[1] for r, st in zip(rows, stock_at)),
            "steps_geomean": geomean([r["kvadmit_steps"] / st[1] for r, st in zip(rows, stock_at)]),
            "stock_retractions": sum(st[0] for st in stock_at)}
        print(f"stock at --schedule-conservativeness {c}: retracts {s['stock_retractions']} in all; "
              f"kvadmit retracts more on {s['more_retractions']}, takes more steps on "
              f"{s['more_steps']}, steps / stock geomean {s['steps_geomean']:.3f}")
    bests = [r for r in rows if r["stock_best_steps"] is not None]
    best = {"workloads": len(bests),
            "more_steps": sum(r["kvadmit_steps"] > r["stock_best_steps"] for r in bests),
            "steps_geomean": geomean([r["kvadmit_steps"] / r["stock_best_steps"] for r in bests])}
    geo_best = "-" if best["steps_geomean"] is None else f"{best['steps_geomean']:.3f}"
    print(f"stock's best setting retracting no more than kvadmit (on {best['workloads']} of "
          f"{len(rows)} workloads one does): kvadmit takes more steps on {best['more_steps']}, "
          f"steps / best geomean {geo_best}")
    s1 = summary["1.0"]
    print(f"{len(rows)} workloads: more retractions than stock on {s1['more_retractions']}, more "
          f"steps on {s1['more_steps']}; steps / stock geomean {s1['steps_geomean']:.3f} "
          f"({time.perf_counter() - t0:.0f} s)")
    path = save(args.out, {"rows": rows, "more_retractions": s1["more_retractions"],
                           "more_steps": s1["more_steps"], "steps_geomean": s1["steps_geomean"],
                           "by_conservativeness": summary, "against_stock_best": best})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
