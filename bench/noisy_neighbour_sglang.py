"""The noisy neighbour (issue 22) on SGLang 0.5.23's real scheduling classes: a batch
flow offering 10x its share beside an interactive flow at its usual rate.

SGLang cannot serve on this CPU (ENGINES.md), so this drives its scheduler's own
classes with a fake forward: tests/sglang/sglang_harness.py (real Req, PrefillAdder,
ScheduleBatch, retraction, allocator, radix cache and the real
_add_request_to_queue; the scheduler loop mirrored), on a virtual clock that moves
by a + b x tokens + c x context seconds a forward (`--step`). Arrivals are Poisson
in that clock. The capacity for each kind of request is measured first (all of a
probe's requests at once: finished / time); the interactive flow then arrives at
`--interactive-load` x its capacity, the batch flow at `--batch-offer` (10) x half
of its capacity, both over `--seconds`. Each run stops when the window is over and
every interactive request is done (the batch backlog is left).

Runs: interactive alone and batch alone (stock SGLang), and both together under
  stock SGLang (FCFS), stock SGLang with --enable-priority-scheduling (interactive
  priority 100, batch 0: larger is more important in SGLang, beyond its preemption
  threshold of 10), kvadmit's default {} (no flows), kvadmit's default with flows
  (custom_params {"kvadmit": {"flow": 1 or 2}}, weight 1 each), and kvadmit's default
  under --enable-priority-scheduling (the same priorities).
Goodput: the interactive requests served within --ttft and --tpot (virtual seconds),
over those alone. Pool utilisation: the time-weighted mean of the tokens SGLang's
allocator has handed out, less the radix cache's evictable tokens (what finished requests left cached), over the
pool, during the window, against batch alone.

    python bench/noisy_neighbour_sglang.py [--seeds 0 1 2]

Results: bench/results/noisy_neighbour_sglang.json.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

from _common import mean_rows, print_table, save

from kvadmit.simulate.workload import _lognormal_int

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The table's columns: (header, key, format).
COLUMNS = (("interactive goodput", "interactive_goodput", ".3f"),
           ("vs alone", "goodput_vs_alone", ".1%"),
           ("interactive TTFT p99 (s)", "interactive_ttft_p99_s", ".2f"),
           ("pool utilisation", "util", ".3f"), ("vs batch only", "util_vs_batch_only", ".1%"),
           ("batch finished", "batch_finished_in_window", ".0f"),
           ("retracted", "retracted", ".1f"), ("displaced", "displaced", ".1f"))


def load_sglang():
    """SGLang's scheduling modules (with the tests' torchvision import shim, see
    tests/sglang/conftest.py) and kvadmit's hooks, as the SGLang tests load them."""
    sys.path.insert(0, str(ROOT / "tests" / "sglang"))
    import conftest  # (imports SGLang's modules under the shim)
    conftest.install_kvadmit_hooks()
    import sglang_harness
    return sglang_harness


def requests(kind, rate, seconds, seed, prompt_mean, output_mean, cap, n=None):
    """(arrival_s, kind, prompt, max_new, out) rows: Poisson over `seconds`, or `n`
    requests all at 0 (a capacity probe)."""
    rng = random.Random(seed)
    rows, t = [], 0.0 if n else rng.expovariate(rate)
    while (len(rows) < n) if n else (t < seconds):
        rows.append((t, kind, _lognormal_int(rng, prompt_mean, 0.8, 4, 2048),
                     cap, _lognormal_int(rng, output_mean, 0.9, 1, cap)))
        if not n:
            t += rng.expovariate(rate)
    return rows


def run(H, rows, mode, args, stop_at=None):
    """One run of `rows` under `mode`; per-request (kind, arrival, ttft, tpot) and the
    pool's mean use during [0, args.seconds]."""
    from kvadmit import AdmissionConfig
    cfg = {"stock": None, "stock-priority": None, "kvadmit-default": {},
           "kvadmit-flows": {"flows": {"1": {"weight": 1}, "2": {"weight": 1}}},
           "kvadmit-priority": {}}[mode]
    prio = mode.endswith("priority")
    h = H.Harness(AdmissionConfig.from_dict(cfg) if cfg is not None else None,
                  pool_tokens=args.pool_tokens, max_running=args.max_running,
                  max_context=4096, enable_priority_scheduling=prio,
                  step_model=tuple(args.step))
    t0 = h.t
    reqs = []
    for i, (arr, kind, p, mx, out) in enumerate(rows):
        kw = {}
        if prio:
            kw["priority"] = 100 if kind == "interactive" else 0
        if mode == "kvadmit-flows":
            kw["custom_params"] = {"kvadmit": {"flow": 1 if kind == "interactive" else 2}}
        reqs.append((arr, kind, H.make_req(f"{kind[0]}{i}", p, mx, out_len=out, seed=args.seed_base, **kw)))
    first, done = {}, {}
    nxt, used_area, last_t = 0, 0.0, 0.0
    active = []                     # submitted, not finished
    inter_left = sum(1 for _, k, _ in reqs if k == "interactive")
    s = h.sched
    while True:
        now = h.t - t0
        while nxt < len(reqs) and reqs[nxt][0] <= now:
            assert h.submit(reqs[nxt][2]), "a request was refused"
            active.append(reqs[nxt])
            nxt += 1
        busy = s.waiting_queue or not s.running_batch.is_empty() or s.chunked_req or (
            s.last_batch is not None and not s.last_batch.is_empty()
            and any(not r.finished() for r in s.last_batch.reqs))
        if stop_at is None and nxt == len(reqs) and not busy:
            break
        if stop_at is not None and now >= stop_at and inter_left == 0:
            break
        if not busy:
            if nxt >= len(reqs):
                break
            h.t = t0 + reqs[nxt][0] + 1e-6   # idle until the next arrival (past it: floats)
            last_t = reqs[nxt][0]
            continue
        # in use by requests: handed out, less what the radix cache keeps of finished
        # ones (evictable)
        used = args.pool_tokens - h.allocator.available_size() - h.tree_cache.evictable_size()
        h.step()
        now2 = h.t - t0
        if last_t < args.seconds:
            used_area += used * (min(now2, args.seconds) - last_t)
        last_t = now2
        keep = []
        for item in active:
            r = item[2]
            k = id(r)
            if k not in first and len(r.output_ids) > 0:
                first[k] = now2
            if r.finished():
                done[k] = now2
                inter_left -= item[1] == "interactive"
            else:
                keep.append(item)
        active = keep
    per = []
    for arr, kind, r in reqs:
        k = id(r)
        f, d = first.get(k), done.get(k)
        n = len(r.output_ids)
        per.append({"kind": kind, "arrival_s": arr, "ttft_s": None if f is None else f - arr,
                    "tpot_s": None if d is None else ((d - f) / (n - 1) if n > 1 else 0.0),
                    "finish_s": d})
    span = min(args.seconds, h.t - t0)
    return per, used_area / (span * args.pool_tokens) if span > 0 else 0.0, h


def summary(per, util, h, args):
    chat = [r for r in per if r["kind"] == "interactive"]
    batch = [r for r in per if r["kind"] == "batch"]
    good = sum(1 for r in chat if r["tpot_s"] is not None and r["ttft_s"] <= args.ttft
               and r["tpot_s"] <= args.tpot)
    tt = sorted(r["ttft_s"] for r in chat if r["ttft_s"] is not None)
    return {"interactive_goodput": good / len(chat) if chat else None,
            "interactive_ttft_p99_s": tt[min(len(tt) - 1, int(0.99 * len(tt)))] if tt else None,
            "util": util,
            "batch_finished_in_window": sum(1 for r in batch if r["finish_s"] is not None
                                            and r["finish_s"] <= args.seconds),
            "retracted": h.log.retracted, "displaced": h.log.displaced,
            "requests": {"interactive": len(chat), "batch": len(batch)}}


def capacity(H, args, kind, prompt, out, cap, seed):
    rows = requests(kind, 0, 0, seed, prompt, out, cap, n=args.probe)
    per, _, h = run(H, rows, "stock", args)
    end = max(r["finish_s"] for r in per)
    return len(per) / end


def one_seed(H, args, seed, progress):
    (pi, oi), (pb, ob) = args.interactive_lengths, args.batch_lengths
    cap_i = capacity(H, args, "interactive", pi, oi, args.interactive_cap, seed + 100)
    cap_b = capacity(H, args, "batch", pb, ob, args.batch_cap, seed + 200)
    rate_i, rate_b = args.interactive_load * cap_i, args.batch_offer * 0.5 * cap_b
    chat = requests("interactive", rate_i, args.seconds, seed + 1, pi, oi, args.interactive_cap)
    batch = requests("batch", rate_b, args.seconds, seed + 2, pb, ob, args.batch_cap)
    both = sorted(chat + batch, key=lambda r: r[0])
    progress(f"seed {seed}: capacity interactive {cap_i:.2f} req/s, batch {cap_b:.2f} req/s; "
             f"offered {rate_i:.2f} ({len(chat)}) and {rate_b:.2f} ({len(batch)}) req/s")
    rows = {}
    for label, rr, mode in (("interactive alone (stock SGLang)", chat, "stock"),
                            ("batch alone (stock SGLang)", batch, "stock"),
                            ("stock SGLang, FCFS", both, "stock"),
                            ("stock SGLang, --enable-priority-scheduling", both, "stock-priority"),
                            ("kvadmit default {}, no flows", both, "kvadmit-default"),
                            ("kvadmit default + flows 1:1", both, "kvadmit-flows"),
                            ("kvadmit default, --enable-priority-scheduling", both, "kvadmit-priority")):
        t = time.time()
        per, util, h = run(H, rr, mode, args, stop_at=args.seconds)
        rows[label] = summary(per, util, h, args)
        progress(f"  {label}: {rows[label]['interactive_goodput']}, util {util:.3f} "
                 f"({time.time() - t:.0f} s)")
    alone = rows["interactive alone (stock SGLang)"]["interactive_goodput"]
    b_util = rows["batch alone (stock SGLang)"]["util"]
    for r in rows.values():
        if r["interactive_goodput"] is not None and alone:
            r["goodput_vs_alone"] = r["interactive_goodput"] / alone
        r["util_vs_batch_only"] = r["util"] / b_util if b_util else None
    return {"seed": seed, "capacity_rps": {"interactive": cap_i, "batch": cap_b},
            "offered_rps": {"interactive": rate_i, "batch": rate_b}, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interactive-load", type=float, default=0.3)
    ap.add_argument("--batch-offer", type=float, default=10.0)
    ap.add_argument("--interactive-lengths", type=float, nargs=2, default=[100, 40])
    ap.add_argument("--batch-lengths", type=float, nargs=2, default=[600, 200])
    ap.add_argument("--interactive-cap", type=int, default=256, help="max_new_tokens (slack)")
    ap.add_argument("--batch-cap", type=int, default=1024, help="max_new_tokens (slack)")
    ap.add_argument("--ttft", type=float, default=1.0)
    ap.add_argument("--tpot", type=float, default=0.1)
    ap.add_argument("--pool-tokens", type=int, default=8000)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--step", type=float, nargs=3, default=[0.02, 2e-5, 2e-7],
                    metavar=("A", "B", "C"), help="seconds a forward: a + b tokens + c context")
    ap.add_argument("--probe", type=int, default=150, help="requests of a capacity probe")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="noisy_neighbour_sglang")
    args = ap.parse_args(argv)
    args.seed_base = 0
    t_start = time.time()

    def progress(msg):
        print(f"[{time.time() - t_start:6.1f} s] {msg}", flush=True)
    H = load_sglang()
    per_seed = [one_seed(H, args, s, progress) for s in args.seeds]
    mean = mean_rows([[{"run": label, **r} for label, r in p["rows"].items()] for p in per_seed],
                     [k for _, k, _ in COLUMNS])
    print(f"\nmean over seeds {args.seeds}:")
    print_table(mean, COLUMNS)
    path = save(args.out, {"args": vars(args), "mean": mean, "seeds": per_seed,
                           "wall_s": time.time() - t_start})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
