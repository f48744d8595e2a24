"""The signals a router in front of several engines can read (issue 15, item 1):
KV headroom, admission pressure and predicted queueing delay, from the core.

Pool: 40 blocks of 4 tokens. Running (20, 20): 40 tokens at its last step, 10
blocks; waiting (12, 8): 3 blocks of prompt."""
import random

import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit.arrival import ArrivalRecord


@pytest.mark.parametrize("policy,forecast", [
    ("peak", 10),          # the running curve's peak
    ("reserve", 10),       # its reservation: prompt + max_new
    ("overcommit", 5),     # what it holds now (20 tokens)
])
def test_headroom_and_pressure(policy, forecast):
    core = make_core(policy, num_blocks=40)
    assert core.router_signals() == {"kv_headroom_blocks": 40, "admission_pressure": 0.0,
                                     "predicted_queue_delay_s": 0.0}
    s = add_running(core, 20, 20)
    core.update(s, 20, 1)
    add_waiting(core, 12, 8)
    sig = core.router_signals()
    assert sig["kv_headroom_blocks"] == 40 - forecast - 3
    assert sig["admission_pressure"] == pytest.approx((forecast + 3) / 40)


def test_pressure_above_one_when_more_is_queued_than_fits():
    core = make_core("peak", num_blocks=40)
    add_running(core, 20, 20)
    for _ in range(12):
        add_waiting(core, 12, 8)          # 12 x 3 blocks of prompt behind a 10-block peak
    sig = core.router_signals()
    assert sig["kv_headroom_blocks"] == 0
    assert sig["admission_pressure"] == pytest.approx((10 + 36) / 40)


def test_predicted_delay_follows_the_admission_rate():
    """Each request waited 0.25 s before its admission: 4 admissions per second of
    backlog (the rate counts time during which requests waited). 4 waiting requests
    are ahead of a new one, so it waits (4 + 1) / 4 = 1.25 s."""
    core = make_core("overcommit", num_blocks=1000)
    for k in range(20):
        s = add_waiting(core, 8, 4, now=k * 0.5)
        core.admit(s, k * 0.5 + 0.25)
    for _ in range(4):
        add_waiting(core, 8, 4, now=10.0)
    delay = core.router_signals()["predicted_queue_delay_s"]
    assert delay == pytest.approx(1.25, rel=0.05)
    assert core.stats()["predicted_queue_delay_s"] == delay      # exported with the counters



def _replay(read_between: bool, seed: int):
    """A queue-capped core under overload: arrivals at seeded random gaps, every
    other one admitting the head, the oldest running request finishing, two engine
    steps between arrivals. With ``read_between`` a router reads the signals after
    every step. Returns every Retry-After hint and the final stats."""
    rng = random.Random(seed)
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=3)
    hints, running, t = [], [], 0.0
    for k in range(200):
        t += rng.uniform(0.05, 0.5)
        r = core.arrive(ArrivalRecord(8, 4), now=t)
        if not r.accepted:
            hints.append(r.rejection.retry_after_s)
        if k % 2:
            s = core.next_admissible(1000)
            if s >= 0:
                core.admit(s, t)
                running.append(s)
        if len(running) > 2:
            core.finish(running.pop(0), t)
        for dt in (rng.uniform(0.0, 0.05), rng.uniform(0.05, 0.1)):
            core.on_step(t + dt)
            if read_between:
                core.router_signals()
    return hints, core.stats()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reading_the_signals_changes_no_later_answer(seed):
    """Reads are reads: a router scraping after every step gets the same Retry-After
    hints and counters, to the last bit, as no scraping at all. (When a read moved
    the backlog clock, up to 2% of a hint changed with the scrape rate.)"""
    quiet_hints, quiet_stats = _replay(False, seed)
    read_hints, read_stats = _replay(True, seed)
    assert len(quiet_hints) > 50                     # the cap refused, with hints
    assert read_hints == quiet_hints
    assert read_stats == quiet_stats
