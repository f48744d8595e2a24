"""Priority retraction (queue_order "priority"): a waiting request the policy holds for
KV may take it from running requests of strictly lower priority (a larger priority
value), lowest first; equal and higher priorities are never displaced; FCFS is
unchanged. The core's rule, engine-free (vLLM's own tests of it:
tests/vllm/test_upstream_priority.py)."""
import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit import AdmissionConfig, ArrivalRecord
from kvadmit.simulate.engine import EngineShape, run_native
from kvadmit.simulate.steptime import CPU_TINY
from kvadmit.simulate.workload import Workload

POLICIES = ["peak", "reserve", "predict", "adaptive", "auto"]


def full_pool(policy, queue_order="priority", running_priority=5):
    """20 blocks of 4 tokens; one running request (36 tokens, 40 more to come: 19 blocks
    at its end) that leaves too little for the waiting one under every policy's rule."""
    core = make_core(policy, queue_order=queue_order)
    add_running(core, 35, 41, generated=1, priority=running_priority)
    return core


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("waiting_priority,queue_order,decision", [
    (0, "priority", "admit"),              # higher: takes the lower one's KV
    (4, "priority", "admit"),
    (5, "priority", "hold_capacity"),      # equal: never displaces it
    (9, "priority", "hold_capacity"),      # lower: never
    (0, "fcfs", "hold_capacity"),          # FCFS: priorities decide nothing
])
def test_a_higher_priority_counts_lower_priority_kv_as_free(policy, waiting_priority,
                                                            queue_order, decision):
    core = full_pool(policy, queue_order)
    s = add_waiting(core, 8, 40, priority=waiting_priority)   # 12 blocks at its end
    # free blocks: the pool less the running request's 9
    assert core.decide(s, 11) == decision
    assert core.next_admissible(11) == (s if decision == "admit" else -1)


@pytest.mark.parametrize("policy", ["peak", "reserve", "auto"])
@pytest.mark.parametrize("waiting,blocks,decision", [
    (2, 8, "admit"),             # takes from 3 and 5: 10 (priority 1) + 8 fit 20
    (2, 11, "hold_capacity"),    # 10 + 11 do not: priority 1 is not its to take
    (0, 12, "admit"),            # takes from all three
    (1, 11, "hold_capacity"),    # equal to the first: only 3 and 5 are its to take
    (4, 6, "hold_capacity"),     # takes from 5 only: 10 + 5 + 6 > 20
    (4, 5, "admit"),             # 10 + 5 + 5 fit
])
def test_only_strictly_lower_priorities_are_taken(policy, waiting, blocks, decision):
    """Running: priority 1 (10 blocks at its end), 3 and 5 (5 blocks each), a full pool
    of 20; a waiting request needing `blocks` at its end. All end 8 steps from now, so
    every rule adds their blocks."""
    core = make_core(policy, queue_order="priority")
    for prompt, pr in ((31, 1), (11, 3), (11, 5)):
        add_running(core, prompt, 9, generated=1, priority=pr)
    s = add_waiting(core, 4 * blocks - 8, 8, priority=waiting)
    assert core.decide(s, 100, check_blocks=False) == decision


@pytest.mark.parametrize("queue_order,victim,first_to_last", [
    # under queue_order "priority" the least important class goes first, whatever the
    # victim order; it orders each class ((prompt, generated, priority) rows below)
    ("priority", "lifo", [4, 2, 0, 3, 1]),       # each class: the latest admitted first
    ("priority", "lcf", [4, 2, 0, 1, 3]),        # each class: the least computed first
    ("priority", "priority", [4, 2, 0, 1, 3]),
    ("fcfs", "lifo", [4, 3, 2, 1, 0]),           # FCFS: the configured order alone
    ("fcfs", "lcf", [4, 0, 2, 1, 3]),
])
def test_victims_go_lowest_priority_first(queue_order, victim, first_to_last):
    core = make_core("overcommit", num_blocks=1000, queue_order=queue_order, victim=victim)
    rows = [(10, 5, 2), (30, 2, 0), (20, 2, 5), (40, 9, 0), (5, 9, 5)]   # computed 14 31 21 48 13
    slots = [add_running(core, p, 50, g, priority=pr) for p, g, pr in rows]
    assert core.victim_order()[::-1] == [slots[i] for i in first_to_last]
    assert core.victim() == slots[first_to_last[0]]


# Pause plan entries (want tokens, computed tokens, held blocks, priority), blocks of 4.
def D1(p):
    return (1, 4, 1, p)      # a decode that needs a new block


def D0(p):
    return (1, 5, 2, p)      # a decode with room in its last block


@pytest.mark.parametrize("reqs,free,paused,fcfs_paused", [
    # one block for two: the more important one gets it, the other sits out
    ([D1(5), D1(0)], 1, [0], [1]),
    ([D1(0), D1(5)], 1, [1], [1]),
    # none free: the short higher one is not paused, the engine preempts the lower
    # one (which holds 2 blocks) for it
    ([D0(5), D1(0)], 0, [], [1]),
    # equal or higher priority is never taken from: the short one sits out
    ([D0(1), D1(1)], 0, [1], [1]),
    ([D0(0), D1(5)], 0, [1], [1]),
    # nothing could run: the most important one runs (without priorities: the first)
    # and the engine preempts for it
    ([(1, 0, 0, 5), (9, 8, 2, 0)], 0, [0], [1]),
    ([D1(5), D1(0), D1(3)], 0, [0, 2], [1, 2]),
])
def test_pause_plan_goes_lowest_priority_first(reqs, free, paused, fcfs_paused):
    want, computed, held, prio = ([r[k] for r in reqs] for k in range(4))
    core = make_core("overcommit", shortfall="pause", queue_order="priority")
    assert core.plan_shortfall(want, computed, held, free, 100, priorities=prio) == paused
    fcfs = make_core("overcommit", shortfall="pause")
    assert fcfs.plan_shortfall(want, computed, held, free, 100, priorities=prio) == fcfs_paused
    assert fcfs.plan_shortfall(want, computed, held, free, 100) == fcfs_paused   # as without them


def test_pause_plan_priorities_need_one_per_request():
    core = make_core("overcommit", shortfall="pause", queue_order="priority")
    with pytest.raises(ValueError, match=r"priorities: 1 entries, expected one per running request \(2\)"):
        core.plan_shortfall([1, 1], [4, 4], [1, 1], 0, 100, priorities=[0])


@pytest.mark.parametrize("queue_order", ["priority", "fcfs"])
def test_in_the_simulator_higher_priorities_do_not_wait_for_lower(queue_order):
    """The native engine, the default config (auto, pause): 8 long low-priority (5)
    requests fill the pool's forecast, then 4 short high-priority (0) ones arrive.
    Under queue_order "priority" every high one starts before any low one finishes
    (a low one gives its KV back: preempted or paused), none of them is preempted;
    under "fcfs" all four wait for a low one to finish: the held low ones have waited
    longer than any admitted request had (0 s), so auto's wait bound lets nothing
    pass them. Either way every request completes with its tokens and every block
    comes back."""
    nl, nh = 8, 4
    wl = Workload("low-then-high", arrival_s=[0.0] * nl + [1.0] * nh,
                  prompt_tokens=[200] * (nl + nh), output_tokens=[600] * nl + [100] * nh,
                  max_tokens=[600] * nl + [100] * nh, priority=[5] * nl + [0] * nh)
    shape = EngineShape(num_blocks=200, block_size=16, max_model_len=1024)
    run = run_native(wl, AdmissionConfig(queue_order=queue_order), shape, CPU_TINY)
    per = run.per_request
    assert per["output_tokens"] == [600] * nl + [100] * nh and run.totals.finished == nl + nh
    assert run.totals.free_blocks_at_end == shape.num_blocks
    high_starts = sorted(per["first_token_s"][nl:])
    first_low_finish = min(per["finish_s"][:nl])
    if queue_order == "priority":
        assert high_starts[-1] < first_low_finish
        assert sum(per["preemptions"][nl:]) == 0
    else:
        assert sum(t > first_low_finish for t in high_starts) == nh


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("threshold,waiting_priority,decision", [
    (0, 4, "admit"),            # the default: any strictly lower priority is taken from
    (3, 1, "admit"),            # 5 - 1 = 4 > 3
    (4, 1, "hold_capacity"),    # 5 - 1 = 4, not more than 4: SGLang's rule
    (4, 0, "admit"),
    (10, 0, "hold_capacity"),   # SGLang's default threshold
])
def test_priority_preemption_threshold(policy, threshold, waiting_priority, decision):
    """priority_preemption_threshold (SGLang's --priority-scheduling-preemption-threshold):
    only running requests less important than the waiting one by more than it are taken
    from."""
    core = make_core(policy, queue_order="priority", priority_preemption_threshold=threshold)
    add_running(core, 35, 41, generated=1, priority=5)
    s = add_waiting(core, 8, 40, priority=waiting_priority)
    assert core.decide(s, 11) == decision


def test_displaceable_is_lowest_first_beyond_the_threshold():
    core = make_core("overcommit", num_blocks=1000, queue_order="priority",
                     priority_preemption_threshold=2)
    slots = {pr: add_running(core, 10, 50, generated=2, priority=pr) for pr in (0, 3, 9, 6)}
    s = add_waiting(core, 10, 10, priority=0)
    assert core.displaceable(s) == [slots[9], slots[6], slots[3]]   # 3 - 0 = 3 > 2
    hi = add_waiting(core, 10, 10, priority=4)
    assert core.displaceable(hi) == [slots[9]]                        # 6 - 4 = 2: not more
    fcfs = make_core("overcommit", num_blocks=1000)
    add_running(fcfs, 10, 50, priority=9)
    assert fcfs.displaceable(add_waiting(fcfs, 10, 10, priority=0)) == []


def test_threshold_beyond_any_priority_difference():
    """Extreme priorities do not overflow the difference."""
    big = (1 << 62) - 1
    core = make_core("peak", queue_order="priority", priority_preemption_threshold=(1 << 63) - 1)
    add_running(core, 35, 41, generated=1, priority=big)
    s = add_waiting(core, 8, 40, priority=-big)
    assert core.decide(s, 11) == "hold_capacity"
    core = make_core("peak", queue_order="priority")
    add_running(core, 35, 41, generated=1, priority=big)
    assert core.decide(add_waiting(core, 8, 40, priority=-big), 11) == "admit"


def test_the_engine_models_scheduling_policy_is_checked():
    with pytest.raises(ValueError, match=r"scheduling_policy='lifo': one of 'fcfs', 'priority'"):
        EngineShape(num_blocks=64, scheduling_policy="lifo")


def test_a_request_may_take_kv_only_under_priority_or_flows():
    """The core's one rule the engines ask before displacing (AdmissionCore.may_take_kv):
    queue_order priority, or flows once a flow id has arrived; not plain FCFS."""
    assert make_core("auto", queue_order="priority").may_take_kv()
    core = make_core("auto")
    assert not core.may_take_kv()
    core.arrive(ArrivalRecord(8, 4, flow=1), now=0.0)
    assert core.may_take_kv()


def test_flows_only_leaves_priority_retraction_out():
    """An engine that does not retract by priority (SGLang with its priority preemption
    off) asks for flow displacement alone: lower priorities are not its to take."""
    core = make_core("overcommit", num_blocks=1000, queue_order="priority")
    slots = [add_running(core, 10, 50, generated=2, priority=pr) for pr in (3, 9)]
    s = add_waiting(core, 10, 10, priority=0)
    assert core.displaceable(s) == [slots[1], slots[0]]
    assert core.displaceable(s, flows_only=True) == []       # no flow over its share either
