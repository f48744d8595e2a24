"""Exact decision tables for every policy, and the head-of-line rules.

Pool: 20 blocks of 4 tokens unless a row says otherwise. A running request is
(prompt, max_new, generated); the candidate is (prompt, max_new).
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import add_running, add_waiting, make_core
from kvadmit.arrival import ArrivalRecord

R1 = [(20, 20, 0)]   # holds 5 blocks now, 10 at most


@pytest.mark.parametrize("policy,running,cand,free,expected", [
    # overcommit: only today's need (prompt blocks) against free blocks.
    ("overcommit", R1, (12, 40), 15, "admit"),
    ("overcommit", R1, (12, 40), 2, "hold_blocks"),
    ("overcommit", R1, (60, 4), 15, "admit"),
    # reserve: 10 + ceil(52/4)=13 > 20; 10 + ceil(28/4)=7 fits.
    ("reserve", R1, (12, 40), 15, "hold_capacity"),
    ("reserve", R1, (12, 16), 15, "admit"),
    ("reserve", R1, (12, 16), 2, "hold_blocks"),
    # peak: the curves never exceed 18 blocks together (k=19: 10 + 8) ...
    ("peak", R1, (12, 40), 15, "admit"),
    # ... but (30, 20) reaches 10 + ceil(49/4)=13 = 23 at k=19.
    ("peak", R1, (30, 20), 15, "hold_capacity"),
    # Finishes interleave; the peak is at k=4: 6 + 5 + 9 = 20 fits, 6 + 5 + 10 does not.
    ("peak", [(20, 20, 0), (8, 10, 5)], (32, 8), 12, "admit"),
    ("peak", [(20, 20, 0), (8, 10, 5)], (33, 8), 12, "hold_capacity"),
    # adaptive without samples is peak.
    ("adaptive", R1, (12, 40), 15, "admit"),
    ("adaptive", R1, (30, 20), 15, "hold_capacity"),
    # predict (admitted this step, full charge 20): 60 free tokens - 20 = 40.
    ("predict", R1, (12, 40), 15, "hold_capacity"),   # 52 >= 40
    ("predict", R1, (12, 20), 15, "admit"),           # 32 < 40
    ("predict", R1, (12, 28), 15, "hold_capacity"),   # 40 >= 40 (SGLang's >=)
])
def test_decision_table(policy, running, cand, free, expected):
    core = make_core(policy)
    for p, m, g in running:
        add_running(core, p, m, g)
    s = add_waiting(core, *cand)
    assert core.decide(s, free) == expected


def test_peak_interleaved_rows_against_brute_force():
    from test_curves import brute_peak
    # (20,20,0) -> t=20 r=20; (8,10,5) -> t=13 r=5; candidates (32,8) / (33,8).
    assert brute_peak([20, 13, 32], [20, 5, 8], 4) == 20
    assert brute_peak([20, 13, 33], [20, 5, 8], 4) == 21


def test_predict_ratio_decays_and_resets_after_preemption():
    core = make_core("predict", num_blocks=100, predict_retract_steps=5)
    a = add_running(core, 20, 20)
    core.on_step(0.0)
    decay = (0.7 - 0.7 * 0.14) / 600
    assert core.new_token_ratio == pytest.approx(0.7 - decay)
    # Running offset now 20 * ratio = 13.98: 60 - 13.98 = 46.02 free tokens.
    s = add_waiting(core, 12, 30)
    assert core.decide(s, 15) == "admit"       # 42 < 46.02
    for _ in range(700):
        core.on_step(0.0)
    assert core.new_token_ratio == pytest.approx(0.7 * 0.14)
    b = add_running(core, 8, 60)
    core.update(a, 25, 6)
    core.update(b, 8 + 39, 40)
    core.preempt(b, 0.0)
    # Kept: a, 6 of 20 generated: (6 + 5 steps x 1 request) / (20 + 1).
    assert core.new_token_ratio == pytest.approx(11 / 21)
    core.on_step(0.0)                            # a preemption step does not decay
    assert core.new_token_ratio == pytest.approx(11 / 21)


@pytest.mark.parametrize("displaced", [False, True])
def test_a_displacement_is_no_forecast_miss(displaced):
    """A request preempted for a waiting one the core let take its KV (priority
    retraction, flow displacement: `displaced`) is the core's choice, not a forecast
    that fell short: SGLang's ratio is not re-estimated and keeps decaying, and
    the adaptive quantile (auto's) does not climb. A preemption for a pool run short
    does both."""
    core = make_core("predict", num_blocks=100, predict_retract_steps=5)
    a, b = add_running(core, 20, 20), add_running(core, 8, 60)
    core.update(a, 25, 6)
    core.preempt(b, 0.0, displaced=displaced)
    core.on_step(0.0)
    decayed = 0.7 - (0.7 - 0.7 * 0.14) / 600
    assert core.new_token_ratio == pytest.approx(decayed if displaced else 11 / 21)

    core = make_core("adaptive", num_blocks=100, adaptive_interval=4)
    q0 = core.quantile
    core.preempt(add_running(core, 4, 20), 0.0, displaced=displaced)
    for _ in range(3):
        add_running(core, 4, 20)          # the 4th admission: the controller looks
    assert core.stats()["preempted"] == 1
    assert (core.quantile == q0) == displaced and core.quantile >= q0


def test_adaptive_uses_the_length_model():
    core = make_core("adaptive", num_blocks=40, adaptive_bucket_tokens=4, adaptive_min_samples=10)
    for _ in range(20):                        # every finished request produced 8 tokens
        s = add_running(core, 4, 100)
        core.update(s, 11, 8)
        core.finish(s, 0.0)
    add_running(core, 20, 100)                 # predicted 8 more, not 100
    s = add_waiting(core, 20, 100)             # predicted 8: peak 7 + 7 = 14 blocks
    assert core.decide(s, 30) == "admit"
    peak = make_core("peak", num_blocks=40)
    add_running(peak, 20, 100)                 # worst case: 30 + 30 blocks at k=99
    assert peak.decide(add_waiting(peak, 20, 100), 30) == "hold_capacity"


def test_strict_fifo_stops_at_the_held_head():
    core = make_core("reserve")
    add_running(core, 20, 20)                  # 10 of 20 blocks reserved
    big = add_waiting(core, 30, 30)            # needs 15 more: held
    small = add_waiting(core, 4, 4)            # would fit
    assert core.next_admissible(15) == -1
    assert core.stats()["held"]["hold_capacity"] == 1
    assert core.waiting() == [big, small]


def test_bypass_lets_smaller_requests_pass_at_most_k_times():
    core = make_core("reserve", head_of_line="bypass", max_bypass=2)
    add_running(core, 20, 20)
    big = add_waiting(core, 30, 30)
    smalls = [add_waiting(core, 2, 2) for _ in range(3)]
    for i in range(2):
        s = core.next_admissible(15)
        assert s == smalls[i]
        core.admit(s, 0.0)
        assert core.info(big)["bypassed"] == i + 1
    assert core.next_admissible(15) == -1      # big has been passed twice: it blocks now


@pytest.mark.parametrize("policy", ["reserve", "auto"])
def test_a_request_that_waited_the_delay_cap_is_not_passed_any_more(policy):
    """Under max_queue_delay_s, bypass passes a held request only until it has
    waited the cap; from then on it blocks the queue (gets the next free KV), so a
    large request is not starved while small ones keep fitting."""
    cfg = {"head_of_line": "bypass", "max_bypass": 1000} if policy == "reserve" else {}
    core = make_core(policy, max_queue_delay_s=100.0, **cfg)
    add_running(core, 20, 20)
    big = add_waiting(core, 30, 30, now=0.0)
    smalls = [add_waiting(core, 2, 2, now=0.0) for _ in range(4)]
    for s, t in zip(smalls, (10.0, 50.0, 99.0)):
        core.on_step(t)
        assert core.next_admissible(15) == s        # passes big: it has waited < 100 s
        core.admit(s, t)
    assert core.info(big)["bypassed"] == 3
    core.on_step(100.0)                             # big has now waited 100 s
    assert core.next_admissible(15) == -1
    if policy == "reserve":                         # without the cap explicit bypass goes on
        nocap = make_core(policy, **cfg)            # (auto learns a bound: test_auto)
        add_running(nocap, 20, 20)
        add_waiting(nocap, 30, 30, now=0.0)
        late = add_waiting(nocap, 2, 2, now=500.0)
        assert nocap.next_admissible(15) == late


def test_priority_order():
    core = make_core("overcommit", queue_order="priority")
    slots = [add_waiting(core, 4, 4, priority=p) for p in (5, 1, 3, 1)]
    assert core.waiting() == [slots[1], slots[3], slots[2], slots[0]]
    assert core.next_admissible(100) == slots[1]
    fcfs = make_core("overcommit")
    slots = [add_waiting(fcfs, 4, 4, priority=p) for p in (5, 1)]
    assert fcfs.waiting() == slots


def test_priority_order_takes_the_engines_arrival_time_then_tie():
    """Under priority order, equal priorities go by the engine's arrival time, then its
    tie-break, then the order they reached the core (vLLM: arrival_time, request id).
    Without priority order both are ignored: the core's arrival order decides."""
    core = make_core("overcommit", queue_order="priority")
    times = [(3.0, 0.0, 0), (1.0, 0.0, 0), (2.0, 5.0, 0), (2.0, -1.0, 0), (0.5, 0.0, 1)]
    slots = [core.arrive(ArrivalRecord(4, 4, priority=p, arrival_time=t, arrival_tie=tie),
                         now=0.0).slot for t, tie, p in times]
    assert core.waiting() == [slots[1], slots[3], slots[2], slots[0], slots[4]]
    a = core.next_admissible(100)
    core.admit(a, 0.0)
    core.preempt(a, 0.0)                            # back to its place, by its own time
    assert core.waiting()[0] == a == slots[1]
    assert core.info(slots[0])["arrival_time"] == 3.0
    fcfs = make_core("overcommit")
    slots = [fcfs.arrive(ArrivalRecord(4, 4, arrival_time=t), now=0.0).slot
             for t in (3.0, 1.0, 2.0)]
    assert fcfs.waiting() == slots
    with pytest.raises(ValueError, match="arrival_time=nan"):
        fcfs.arrive(ArrivalRecord(4, 4, arrival_time=float("nan")), now=0.0)


def test_preempted_request_returns_ahead_of_later_arrivals():
    core = make_core("overcommit")
    a = add_running(core, 8, 8)
    later = add_waiting(core, 8, 8)
    core.preempt(a, 0.0)
    assert core.waiting() == [a, later]
    assert core.info(a)["preemptions"] == 1


running_sets = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(0, 39)),
                        max_size=8)


@given(running_sets, st.integers(1, 40), st.integers(1, 40), st.sampled_from([1, 4, 16]))
def test_peak_admits_whenever_reserve_does(running, cp, cm, B):
    cores = {p: make_core(p, num_blocks=40, block_size=B) for p in ("reserve", "peak")}
    for p, m, g in running:
        g = min(g, m - 1)
        for core in cores.values():
            res = core.arrive(ArrivalRecord(p, m), now=0.0)
            if not res.accepted:
                break
            core.admit(res.slot, 0.0)
            if g:
                core.update(res.slot, p + g - 1, g)
    ok = {}
    for name, core in cores.items():
        res = core.arrive(ArrivalRecord(cp, cm), now=0.0)
        ok[name] = res.accepted and core.decide(res.slot, 40) == "admit"
    if ok["reserve"]:
        assert ok["peak"]


def test_update_many_is_all_or_nothing():
    """One bad entry refuses the whole step's update: the entries before it are not
    applied (the engine's step is reported whole or not at all)."""
    core = make_core("peak", num_blocks=100)
    a = add_running(core, 20, 20)
    b = add_running(core, 20, 20)
    peak = core.peak_blocks()
    with pytest.raises(ValueError, match="computed_tokens=99"):
        core.update_many([a, b], [21, 99], [1, 1])
    assert core.info(a)["generated_tokens"] == 0 and core.info(a)["computed_tokens"] == 0
    assert core.peak_blocks() == peak
    core.update_many([a, b], [21, 21], [1, 1])
    assert core.info(a)["generated_tokens"] == core.info(b)["generated_tokens"] == 1


def _first_admissible(core, free, max_bypass, lookahead):
    """next_admissible's scan, one decide() at a time (no scan cache): the queue in
    order; a held request stops it unless bypass lets later ones pass, within the
    lookahead."""
    scanned = 0
    for i, s in enumerate(core.waiting()):
        if core.decide(s, free) == "admit":
            return s
        if core.info(s)["bypassed"] >= max_bypass:
            return -1
        if i > 0:
            scanned += 1
            if scanned >= lookahead:
                return -1
    return -1


@pytest.mark.parametrize("policy", ["peak", "adaptive", "auto"])
@pytest.mark.parametrize("seed", range(6))
def test_queue_scan_answers_as_one_decide_at_a_time(policy, seed):
    """next_admissible skips the peak computation for a request whose curve covers
    one refused earlier in the same scan; its answer stays the first admissible
    request, step after step, as admissions, progress and finishes change the pool."""
    import random
    rng = random.Random(seed)
    core = make_core(policy, num_blocks=rng.randint(40, 160), block_size=4,
                     head_of_line="bypass", max_bypass=6, bypass_lookahead=5)
    running = []
    for step in range(120):
        for _ in range(rng.randint(0, 3)):
            core.arrive(ArrivalRecord(rng.randint(1, 60), rng.randint(1, 60)), now=step)
        free = rng.randint(0, core.num_blocks)
        want = _first_admissible(core, free, 6, 5)
        got = core.next_admissible(free)
        assert got == want, (step, got, want)
        if got >= 0:
            core.admit(got, step)
            running.append(got)
        for s in list(running):
            info = core.info(s)
            g = info["generated_tokens"] + 1
            if g >= info["max_new_tokens"] or rng.random() < 0.05:
                core.finish(s, step)
                running.remove(s)
            else:
                core.update(s, info["prompt_tokens"] + g - 1, g)
        core.on_step(step)
