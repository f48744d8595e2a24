"""A digest of the native engine's decisions, to prove a refactor changes none.

Runs every scorecard workload under every scorecard row, plus configs that reach
the core's other parts (reserve, predict, victims, priority shedding and queue
caps, the SLO guard with deadline order, the agent window, chunked-prefill
reservation), and hashes each run's per-request results (arrival, first token,
finish, output tokens, preemptions, rejection reason), totals and core stats.
Two builds decide identically when their digests match.

    python bench/parity_digest.py                  # print the digest, save it
    python bench/parity_digest.py --check          # compare with the saved one; exit 1 if different

Saved to bench/results/parity_digest.json (one digest per run and one overall).
Floating-point results are hashed at full precision: compare builds made by the
same compiler on the same machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

from _common import RESULTS

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.run import run_policy
from kvadmit.simulate.scorecard import CONFIGS, suite


# Configs beyond the scorecard's rows: each reaches a part of the core the rows do not.
EXTRA = {
    "azure-context": ['reserve={"policy": "reserve"}',
                      'predict={"policy": "predict"}',
                      'overcommit-lcf={"policy": "overcommit", "victim": "lcf"}',
                      'overcommit-length={"policy": "overcommit", "victim": "length"}',
                      'adaptive-chunk={"policy": "adaptive", "prefill_chunk_tokens": 256}'],
    "gamma-bursty": ['reserve={"policy": "reserve"}',
                     'caps-shed={"max_queued_requests": 64, "max_queued_tokens": 200000, '
                     '"shed_lower_priority": true, "queue_order": "priority", "victim": "priority"}',
                     'slo-deadline={"slo_guard": true, "queue_order": "deadline", '
                     '"default_ttft_slo_s": 2.0, "default_tpot_slo_s": 0.05, "max_queue_delay_s": 5.0}',
                     'predict={"policy": "predict", "shortfall": "preempt"}'],
    "agents": ['agent-window={"agent_window": true}',
               'agent-window-peak={"agent_window": true, "policy": "peak", "agent_window_init": 2}'],
}


def run_digest(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the saved digest")
    ap.add_argument("--out", default=str(RESULTS / "parity_digest.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    runs = {}
    for case in suite():            # the traces bundled in the package
        for row in list(CONFIGS) + EXTRA.get(case.name, []):
            spec = parse_policy(row)
            raw = run_policy(case.workload, spec, "native", case.shape, case.step, AdmissionConfig())
            runs[f"{case.name}/{spec.name}"] = run_digest(
                # totals as the dict NativeEngine.totals() gave (the saved digests hash it)
                [raw.per_request, raw.totals.as_dict(), raw.extra.get("core", {})])
            print(f"  {case.name}/{spec.name}: {runs[f'{case.name}/{spec.name}']}", file=sys.stderr)
    overall = run_digest(runs)
    print(f"{len(runs)} runs, digest {overall} ({time.perf_counter() - t0:.0f} s)")
    out = pathlib.Path(args.out)
    if args.check:
        saved = json.loads(out.read_text())
        diff = sorted(k for k in set(saved["runs"]) | set(runs) if saved["runs"].get(k) != runs.get(k))
        if diff:
            print(f"DIFFERENT from {out} ({saved['digest']}): {', '.join(diff)}")
            return 1
        print(f"same as {out}")
        return 0
    out.write_text(json.dumps({"digest": overall, "runs": runs,
                               "command": "python bench/parity_digest.py"}, indent=1) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
