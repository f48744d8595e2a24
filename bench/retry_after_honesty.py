"""Retry-After against the real wait: a burst on the native engine, clients that retry.

One native engine model (two speeds) (kvadmit._native.NativeEngine, stepped on its own clock)
with `max_queued_requests` takes a burst of requests at t = 0 (seeded sizes). Every
refused client comes back when it is told to, until it is taken:

- ``on-time``: at the refusal plus the core's hint (what the simulator's clients do);
- ``http``: at the refusal plus the hint as the Retry-After header has it (whole
  seconds, at least 1: kvadmit.protocol.retry_after_header);
- ``router``: behind vllm-router's defaults: each refusal is retried by the router
  after 50 ms, x1.5, 5 attempts in all (Retry-After ignored), and only the last
  refusal's hint reaches the client, which comes back then (through the router).

For each refusal: the hint given, and the real wait until that client was taken
into the queue (its accepted arrival less the refusal's time). A hint too short
shows as a return refused again (actual > hint); a hint too long as room idle
while clients wait: seconds during which the queue had room (fewer than
max_queued_requests waiting) while some refused client was waiting out its hint.

    python bench/retry_after_honesty.py [--requests 120] [--cap 16] [--label after]

Saves bench/results/retry_after_honesty_<label>.json (the command and machine
inside). To compare with another build, run it with that build's package first on
the path (e.g. PYTHONPATH=<checkout>/scheduler).
"""
from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys

from _common import save

import kvadmit
from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit import Requests

ROUTER_DELAYS = [0.05, 0.075, 0.1125, 0.16875]     # vllm-router: 5 attempts in all
BEHAVIOURS = ("on-time", "http", "router")
TICK = 0.01
STEPS = (0.02, 0.0025)                              # engine step times (s)


def engine(cap: int, step_s: float) -> NativeEngine:
    # 8 sequences at most, steps of step_s plus 20 us per token: with 20 ms steps a
    # request of 32-256 output tokens takes 1-5 s and the engine takes about 3
    # requests a second; with 2.5 ms steps about 8 times that.
    return NativeEngine(AdmissionConfig(max_queued_requests=cap), 4096, 16, 4096, 8, 2048,
                        step_a=step_s, step_b=2e-5 * step_s / 0.02, step_c=0.0)


def summary(told: list[dict]) -> dict:
    if not told:
        return {"told": 0}
    errs = sorted(x["actual"] - x["hint"] for x in told)
    return {
        "told": len(told),
        "hint_mean_s": statistics.fmean(x["hint"] for x in told),
        "actual_mean_s": statistics.fmean(x["actual"] for x in told),
        "actual_minus_hint_p50_s": errs[len(errs) // 2],
        "actual_minus_hint_p90_s": errs[int(0.9 * (len(errs) - 1))],
        # taken when it came back (within the engine's step and the driver's tick)
        "taken_at_return": sum(1 for x in told if x["actual"] - x["back"] < 0.05) / len(told),
    }


def run(behaviour: str, n: int, cap: int, seed: int, step_s: float) -> dict:
    rng = random.Random(seed)
    sizes = [(rng.randint(64, 512), rng.randint(32, 256)) for _ in range(n)]
    e = engine(cap, step_s)
    e.start(0.0)
    owner: list[int] = []                 # engine request index -> client

    def add(t: float, clients: list[int]) -> None:
        e.add_requests(Requests([t] * len(clients), [sizes[c][0] for c in clients],
                [sizes[c][1] for c in clients], [sizes[c][1] for c in clients]))
        owner.extend(clients)

    add(0.0, list(range(n)))
    due: list[tuple[float, int, int]] = []     # (time, order, client)
    seq = 0
    router_step = [0] * n                      # router attempts so far in this client try
    waiting_out = [0] * n                      # 1 while the client waits out a hint
    refusals: list[dict] = []                  # per refusal: client, time, hint, router?
    idle_room_s = 0.0
    clamped = 0
    t = 0.0
    while True:
        nxt = min(due[0][0], t + TICK) if due else t + TICK
        nxt = max(nxt, t)
        e.advance(nxt)
        sig = e.signals()
        if sig["num_requests_waiting"] < cap and any(waiting_out):
            idle_room_s += nxt - t
        t = nxt
        for r, reason, t_ref, hint in e.take_rejections():
            c = owner[r]
            assert reason == "queue_full" and hint is not None, (reason, hint)
            if behaviour == "router" and router_step[c] < len(ROUTER_DELAYS):
                back, by_router = t_ref + ROUTER_DELAYS[router_step[c]], True
                router_step[c] += 1
            else:
                wait = hint if behaviour == "on-time" else max(1, math.ceil(hint))
                back, by_router = t_ref + wait, False
                router_step[c] = 0
                waiting_out[c] = 1
            refusals.append({"client": c, "t": t_ref, "hint": hint, "router": by_router,
                             "back": back - t_ref})
            if back < t:
                clamped += 1
                back = t
            heapq.heappush(due, (back, seq, c))
            seq += 1
        now_due = []
        while due and due[0][0] <= t:
            now_due.append(heapq.heappop(due)[2])
        if now_due:
            for c in now_due:
                waiting_out[c] = 0
            add(t, now_due)
        elif not due and sig["num_requests_waiting"] == 0 and sig["num_requests_running"] == 0:
            break
    e.drain()
    res = e.results()
    taken = {}
    for r, c in enumerate(owner):
        if res["rejected"][r] is None:
            taken[c] = res["arrival_s"][r]
    assert len(taken) == n, (len(taken), n)
    rows = []
    for x in refusals:
        rows.append({**x, "actual": taken[x["client"]] - x["t"]})
    # What a client is told: every refusal without the router; behind it, the last one
    # of each router try (the others never leave the router).
    told = [x for x in rows if not x["router"]]
    refused = {x["client"] for x in rows}
    return {
        "behaviour": behaviour, "step_s": step_s, "requests": n, "cap": cap, "seed": seed,
        "refused_clients": len(refused), "refusals": len(rows),
        "refusals_told_per_refused_client": len(told) / max(len(refused), 1),
        "all": summary(told),
        # once the pace is measured (over retry_after_default_s = 1 s of backlog)
        "after_1s": summary([x for x in told if x["t"] >= 1.0]),
        "idle_room_s": idle_room_s,
        "last_taken_s": max(taken[c] for c in refused),
        "mean_taken_s": statistics.fmean(taken[c] for c in refused),
        "sample_hint_actual_s": [(round(x["hint"], 3), round(x["actual"], 3))
                                 for x in told[:: max(1, len(told) // 8)]][:8],
        "clamped_returns": clamped,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="after")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    out = [run(b, args.requests, args.cap, args.seed, step) for step in STEPS for b in BEHAVIOURS]
    print(f"kvadmit from {kvadmit.__file__}")
    print(f"{'step':>6} {'clients':8} {'refused':>7} {'told/client':>11} | {'hint':>6} {'actual':>6} "
          f"{'act-hint p50':>12} {'p90':>6} {'taken at return':>15} | after 1 s: {'hint':>6} "
          f"{'actual':>6} {'p50':>5} {'taken':>6} | {'idle room s':>11} {'last taken s':>12}")
    for r in out:
        a, b = r["all"], r["after_1s"]
        print(f"{r['step_s'] * 1000:4.1f}ms {r['behaviour']:8} {r['refused_clients']:7d} "
              f"{r['refusals_told_per_refused_client']:11.2f} | {a['hint_mean_s']:6.2f} "
              f"{a['actual_mean_s']:6.2f} {a['actual_minus_hint_p50_s']:12.2f} "
              f"{a['actual_minus_hint_p90_s']:6.2f} {a['taken_at_return']:15.0%} | "
              + (f"{'':10} {b['hint_mean_s']:6.2f} {b['actual_mean_s']:6.2f} "
                 f"{b['actual_minus_hint_p50_s']:5.2f} {b['taken_at_return']:6.0%} | "
                 if b["told"] else f"{'':10} {'(none told)':>26} | ") +
              f"{r['idle_room_s']:11.2f} {r['last_taken_s']:12.2f}")
    if not args.no_save:
        path = save(f"retry_after_honesty_{args.label}", {"kvadmit": kvadmit.__file__,
                                                          "tick_s": TICK, "runs": out})
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
