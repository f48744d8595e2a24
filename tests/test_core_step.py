"""The core's step sequence without an engine (`AdmissionCore.step` / `step_done`, the
one place a step's order is written: the core port translates onto it, the
native engine model calls its c_ twins), with injected times, checked exactly."""
import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit._native import NativeEngine, Requests
from kvadmit.arrival import ArrivalRecord
from kvadmit.config import AdmissionConfig


def fit_after(observations, **cfg):
    """The step-time fit of a core told these (tokens, context, seconds) directly."""
    core = make_core("peak", num_blocks=40, **cfg)
    for tokens, context, seconds in observations:
        core.observe_step(tokens, context, seconds)
    return core.stats()["step_time_fit"]


def test_a_steps_time_is_the_interval_to_the_next_start_charged_to_what_it_scheduled():
    core = make_core("peak", num_blocks=40)
    core.step(1.0, 0)
    core.step_done(64, 640, 1.0)
    core.step(1.5, 0)                                   # 0.5 s for 64 tokens over 640
    core.step_done(0, 0, 1.5)                           # nothing ran
    core.step(9.0, 0)                                   # idle: no step time
    core.step_done(32, 320, 9.0)
    core.step(9.25, 0, fresh=False)                     # an interval that skipped an iteration
    core.step_done(16, 160, 9.25)
    core.engine_idle()                                  # the engine had nothing to run
    core.step(20.0, 0)
    core.step_done(8, 80, 20.0)
    core.step(19.0, 0)                                  # a clock that went back: not observed
    assert core.observed_steps == 1
    assert core.stats()["step_time_fit"] == fit_after([(64, 640, 0.5)])


def test_a_known_step_time_is_observed_as_given_even_without_tokens():
    """An engine model knows each step's time (the native engine: a step that lost its
    whole batch to preemption still took its fixed cost)."""
    core = make_core("peak", num_blocks=40)
    core.step(0.0, 0)
    core.step_done(64, 640, 0.0, seconds=0.125)
    core.step(7.0, 0, fresh=False)                      # the interval does not matter
    core.step_done(0, 0, 7.0, seconds=0.01)
    core.step(7.01, 0)
    assert core.observed_steps == 2
    assert core.stats()["step_time_fit"] == fit_after([(64, 640, 0.125), (0, 0, 0.01)])


def test_step_done_steps_the_core_at_the_steps_time():
    core = make_core("predict", num_blocks=40)
    add_running(core, 8, 8)
    add_waiting(core, 8, 8, now=0.5)
    ratio = core.new_token_ratio
    core.step(2.0, 0)
    assert core.new_token_ratio == ratio                # the start decides nothing yet
    core.step_done(1, 8, 2.0)
    assert core.new_token_ratio < ratio                 # on_step: the ratio decays


def test_the_steps_progress_admits_what_started_outside_the_gate_then_applies_counts():
    core = make_core("peak", num_blocks=40, victim="length")
    a = add_running(core, 8, 20)
    b = add_waiting(core, 8, 4)                         # the engine started it on its own
    order = core.step(1.0, 6, [a, b], [10, 9], [2, 1])
    assert core.state(b) == "running" and core.num_running == 2
    assert core.info(a)["computed_tokens"] == 10 and core.info(b)["generated_tokens"] == 1
    assert sorted(order) == [a, b] and order == core.victim_order()


def test_a_refused_step_changes_nothing():
    core = make_core("peak", num_blocks=40)
    a = add_running(core, 8, 20)
    b = add_waiting(core, 8, 4)
    core.step(0.0, 0)
    core.step_done(64, 640, 0.0)
    with pytest.raises(ValueError, match="computed_tokens=99"):
        core.step(0.5, 0, [b, a], [0, 99], [0, 2])      # a's count is impossible
    with pytest.raises(ValueError, match="step: 1 slots but 2 computed_tokens"):
        core.step(0.5, 0, [a], [1, 2], [0, 0])
    with pytest.raises(ValueError, match="used_blocks=-1"):
        core.step(0.5, -1)
    with pytest.raises(ValueError, match="now=inf"):
        core.step(float("inf"), 0)
    assert core.state(b) == "waiting" and core.info(a)["computed_tokens"] == 0
    assert core.observed_steps == 0
    core.step(0.5, 0)                                   # the step's time is still there
    assert core.observed_steps == 1
    with pytest.raises(ValueError, match="tokens=-1"):
        core.step_done(-1, 0, 0.5)
    with pytest.raises(ValueError, match="hit_tokens=-1"):
        core.step_done(1, 1, 0.5, hit_tokens=-1)
    with pytest.raises(ValueError, match="seconds=nan"):
        core.step_done(1, 1, 0.5, seconds=float("nan"))


def test_the_window_sees_the_prefix_hits_noted_since_the_previous_start():
    core = make_core("peak", num_blocks=100, agent_window=True, agent_window_init=3,
                     agent_cooldown_intervals=0, agent_interval_s=0.0)
    slots = [core.arrive(ArrivalRecord(10, 5, session=s), now=0.0).slot for s in (1, 2, 3)]
    for s in slots:
        core.admit(s, 0.0)
    core.step(0.0, 10)
    core.note_prefix_hits(0, 60)                        # admitted this step: nothing cached
    core.step_done(30, 30, 0.0, hit_tokens=0, query_tokens=40)
    assert core.pending_prefix_hits == (0, 100)
    assert (core.prefix_hit_tokens, core.prefix_query_tokens) == (0, 100)
    window = core.agent_window_size
    core.step(0.1, 90)                                  # 90 of 100 blocks, no hits: thrashing
    assert core.pending_prefix_hits == (0, 0)
    assert core.agent_window_size < window


def test_blocks_in_use_reach_the_policy_only_where_shared_prefixes_are_counted():
    def admissible(counts):
        core = make_core("auto", num_blocks=40, block_size=4)
        core.counts_shared_prefix = counts
        s = add_running(core, 8, 4)
        core.step(0.0, 30, [s], [8], [0])               # 30 blocks in use, 2 its own
        b = add_waiting(core, 40, 4)                    # 11 blocks at its peak
        return core.next_admissible(10, False) == b
    assert not admissible(True) and admissible(False)


def test_the_native_engine_runs_the_same_sequence_once_a_step():
    """The engine model calls the c_ twins once per step it runs: every step's known
    time reaches the fit, and the step counter of the core moves with it."""
    e = NativeEngine(AdmissionConfig(), 64, 16, 2048, 64, 512, step_a=0.01, step_b=2e-5)
    n = 40
    e.add_requests(Requests([0.05 * i for i in range(n)], [100 + 7 * i for i in range(n)],
                            [20 + i for i in range(n)], [200] * n))
    e.run()
    steps = e.totals()["steps"]
    assert steps > n
    assert e.core.observed_steps == steps
    assert e.core.stats()["step_time_fit"]["observations"] == steps
    assert e.core.counts_shared_prefix
