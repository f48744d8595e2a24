"""SLO admission: the online step-time fit, the TTFT guard (slo_infeasible), the
TPOT guard (hold_slo), deadline order, and no accept/reject oscillation."""
import random

import pytest

from helpers import make_core
from kvadmit import AdmissionConfig
from kvadmit._native import StepTimeFit
from kvadmit.arrival import ArrivalRecord

EXACT = dict(slo_guard=True, step_time_a=0.01, step_time_b=0.001, step_time_c=0.0,
             step_time_forgetting=1.0)


def test_rls_fit_converges_on_noisy_step_times():
    truth = (0.012, 3.0e-5, 6.0e-8)
    fit = StepTimeFit(0.002, 1.0e-5, 0.0)            # a rough preset to start from
    rng = random.Random(0)
    for _ in range(300):
        tokens, context = rng.randint(1, 8192), rng.randint(0, 600_000)
        t = truth[0] + truth[1] * tokens + truth[2] * context
        fit.observe(tokens, context, t * rng.uniform(0.98, 1.02))
    for got, want in zip(fit.coefficients, truth):
        assert got == pytest.approx(want, rel=0.05)
    assert fit.predict(4096, 300_000) == pytest.approx(0.012 + 3e-5 * 4096 + 6e-8 * 300_000, rel=0.01)
    assert fit.observations == 300


def test_rls_fit_follows_a_change_with_forgetting():
    fit = StepTimeFit(0.01, 1e-5, 1e-8, forgetting=0.98)
    rng = random.Random(1)
    for a in (0.01, 0.03):                            # the hardware gets slower
        for _ in range(400):
            tokens, context = rng.randint(1, 4096), rng.randint(0, 100_000)
            fit.observe(tokens, context, a + 1e-5 * tokens + 1e-8 * context)
    assert fit.coefficients[0] == pytest.approx(0.03, rel=0.02)


@pytest.mark.parametrize("bad", [dict(a=-1.0), dict(forgetting=0.1), dict(prior_std_s=0.0)])
def test_rls_fit_refuses_bad_settings(bad):
    args = dict(a=0.01, b=0.0, c=0.0)
    args.update(bad)
    with pytest.raises(ValueError):
        StepTimeFit(**args)


@pytest.mark.parametrize("tokens, context, seconds, match", [
    (float("nan"), 0.0, 0.01, "tokens=nan"), (1.0, float("inf"), 0.01, "context=inf"),
    (-1.0, 0.0, 0.01, "tokens=-1.0"), (1.0, 0.0, float("nan"), "seconds=nan"),
])
def test_a_bad_step_observation_is_refused_and_leaves_the_fit_and_guard_as_they_were(
        tokens, context, seconds, match):
    """A NaN would poison the fit (and the guard's tokens-a-step average) for good."""
    core = make_core("overcommit", num_blocks=1000, **EXACT)
    core.observe_step(100, 1000, 0.11)
    before = (core.step_time.coefficients, core.predict_ttft(100, 0.0))
    with pytest.raises(ValueError, match=match):
        core.observe_step(tokens, context, seconds)
    assert (core.step_time.coefficients, core.predict_ttft(100, 0.0)) == before
    assert core.step_time.observations == 1


def hand_built_queue():
    """3 waiting requests of 100 prompt tokens, nothing running, a 100-token step budget."""
    core = make_core("overcommit", num_blocks=1000, **EXACT)
    core.set_step_budget(100)
    for _ in range(3):
        assert core.arrive(ArrivalRecord(100, 10, ttft_slo_s=10.0), now=0.0).accepted
    return core


def test_ttft_guard_refuses_exactly_the_infeasible():
    # Prefilling 300 + 50 tokens at 100 a step: 4 steps of 87.5 tokens, 0.0975 s each.
    core = hand_built_queue()
    assert core.predict_ttft(50, 0.0) == pytest.approx(0.39)
    res = core.arrive(ArrivalRecord(50, 10, ttft_slo_s=0.38), now=0.0)
    assert not res.accepted
    r = res.rejection
    assert (r.reason, r.limit, r.limit_value) == ("slo_infeasible", "ttft_slo_s", 0.38)
    assert r.retryable and r.retry_after_s == pytest.approx(0.01)
    assert "predicted TTFT 0.39 s" in r.message
    assert core.arrive(ArrivalRecord(50, 10, ttft_slo_s=0.39), now=0.0).accepted  # just feasible
    assert core.arrive(ArrivalRecord(50, 10, ttft_slo_s=0.0), now=0.0).accepted  # 0: no target
    assert core.stats()["rejected"]["slo_infeasible"] == 1


def test_ttft_guard_uses_the_servers_default_target():
    core = make_core("overcommit", num_blocks=1000, default_ttft_slo_s=0.2, **EXACT)
    core.set_step_budget(100)
    assert core.arrive(ArrivalRecord(100, 10), now=0.0).accepted  # 1 step: 0.11 s
    res = core.arrive(ArrivalRecord(100, 10), now=0.0)  # 2 steps: 0.22 s
    assert res.rejection.reason == "slo_infeasible" and "ttft_slo_s=0.2" in res.rejection.message
    # its own target wins
    assert core.arrive(ArrivalRecord(100, 10, ttft_slo_s=0.25), now=0.0).accepted


def test_ttft_guard_is_off_without_slo_guard():
    core = make_core("overcommit", num_blocks=1000, step_time_a=1.0)
    assert core.arrive(ArrivalRecord(100, 10, ttft_slo_s=0.001), now=0.0).accepted


def test_deadline_order_serves_the_earliest_deadline_first():
    core = make_core("overcommit", num_blocks=1000, queue_order="deadline", **EXACT)
    late = core.arrive(ArrivalRecord(10, 5, ttft_slo_s=30.0), now=0.0).slot
    soon = core.arrive(ArrivalRecord(10, 5, ttft_slo_s=2.0), now=1.0).slot
    none = core.arrive(ArrivalRecord(10, 5, ttft_slo_s=0.0), now=0.5).slot  # no target: an hour
    assert core.waiting() == [soon, late, none]


def test_deadline_order_predicts_from_the_requests_ahead_only():
    core = make_core("overcommit", num_blocks=1000, queue_order="deadline", **EXACT)
    core.set_step_budget(100)
    for _ in range(5):
        assert core.arrive(ArrivalRecord(100, 10, ttft_slo_s=60.0), now=0.0).accepted
    # 50 tokens with an earlier deadline than all five: only its own prefill counts.
    assert core.arrive(ArrivalRecord(50, 10, ttft_slo_s=0.061), now=0.0).accepted   # 1 step: 0.06 s
    # FCFS would put it behind 500 tokens.
    fcfs = make_core("overcommit", num_blocks=1000, **EXACT)
    fcfs.set_step_budget(100)
    for _ in range(5):
        fcfs.arrive(ArrivalRecord(100, 10, ttft_slo_s=60.0), now=0.0)
    res = fcfs.arrive(ArrivalRecord(50, 10, ttft_slo_s=0.061), now=0.0)
    assert res.rejection.reason == "slo_infeasible"


def test_tpot_guard_holds_the_admission_that_slows_steps_too_much():
    # A decode step of n requests takes 0.01 + 0.001 n: a 0.05 s target allows 40.
    core = make_core("overcommit", num_blocks=10_000, **EXACT)
    slots = [core.arrive(ArrivalRecord(4, 4, tpot_slo_s=0.05), now=0.0).slot for _ in range(41)]
    admitted = 0
    while (s := core.next_admissible(10_000)) >= 0:
        core.admit(s, 0.0)
        admitted += 1
    assert admitted == 40
    assert core.decide(slots[40], 10_000) == "hold_slo"
    assert core.stats()["held"]["hold_slo"] >= 1
    # Once one finishes there is room again.
    core.finish(slots[0], 0.0)
    assert core.next_admissible(10_000) == slots[40]


def test_tpot_guard_never_holds_on_an_idle_engine():
    core = make_core("overcommit", num_blocks=100, slo_guard=True, step_time_a=1.0)
    s = core.arrive(ArrivalRecord(4, 4, tpot_slo_s=0.01), now=0.0).slot
    assert core.next_admissible(100) == s


def test_no_accept_all_reject_all_oscillation_under_a_steady_overload():
    """Mooncake's failure mode: a guard that only measures admits a burst, sees the
    damage, refuses everything, and so on. Predicting at arrival from the queue ahead
    keeps the acceptance share steady: no window of 200 arrivals is all-accept or
    all-reject, and the shares stay within 0.3 of each other."""
    from kvadmit.simulate import EngineShape, get_preset, run_native, synthetic
    from kvadmit.simulate.run import at_load, capacity_rps
    step = get_preset("h100-8b")
    shape = EngineShape(num_blocks=step.num_blocks)
    w = synthetic(6000, 10.0, seed=2)
    w = at_load(w, 1.5, capacity_rps(w, shape, step))
    w.ttft_slo_s = [2.0] * len(w)
    w.tpot_slo_s = [0.0] * len(w)
    raw = run_native(w, AdmissionConfig(policy="adaptive", slo_guard=True), shape, step)
    rejected = [r is not None for r in raw.per_request["rejected"]]
    shares = [1 - sum(rejected[i:i + 200]) / 200 for i in range(1000, len(w) - 200, 200)]
    assert 0.05 < sum(rejected) / len(w) < 0.6
    assert min(shares) > 0.05 and max(shares) < 0.99 and max(shares) - min(shares) < 0.3, shares


def test_rls_fit_stays_finite_when_a_feature_never_varies():
    import math
    fit = StepTimeFit(0.008, 3.25e-5, 4.9e-8)
    for n in range(150_000):                     # one request decoding: tokens == 1
        ctx = 1000 + n % 8000
        fit.observe(1, ctx, 0.008 + 3.25e-5 + 4.9e-8 * ctx)
    assert all(math.isfinite(c) for c in fit.coefficients)
    assert fit.predict(1, 5000) == pytest.approx(0.008 + 3.25e-5 + 4.9e-8 * 5000, rel=1e-3)


def test_backlog_clock_does_not_count_a_quiet_period_before_a_preemption():
    core = make_core("overcommit", num_blocks=1000, max_queue_delay_s=2.0, drain_window_s=1000)
    a = core.arrive(ArrivalRecord(10, 5), now=0.0).slot
    b = core.arrive(ArrivalRecord(10, 5), now=0.0).slot
    core.admit(a, 0.0)
    core.admit(b, 0.0)
    core.preempt(b, now=100.0)                   # the queue was empty for those 100 s
    core.admit(b, 100.01)
    assert core.arrive(ArrivalRecord(10, 5), now=100.02).accepted
    assert core.arrive(ArrivalRecord(10, 5), now=100.02).accepted
