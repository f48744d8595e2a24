"""The step planner (kvadmit._step_plan), engine-free: the prompt's block need, the
displacement rule (the fewest victims, first first, that free the candidate's need and
the watermark beside it, or none) and the pause plan over the running rows. The engines
that fill its view are tested against vLLM's scheduler in tests/simulate/test_vllm_engine.py
and tests/vllm/test_priority_displacement.py."""
import random

import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit import StepPlanner, prompt_blocks


@pytest.mark.parametrize("tokens,computed,hits,fresh,cap,lookahead,need", [
    (100, 0, 0, 0, 100, 0, 7),     # ceil(100 / 16)
    (100, 0, 2, 0, 100, 0, 5),     # two hit blocks: 68 tokens left
    (100, 0, 2, 1, 100, 0, 6),     # one hit is cached-free: taking it takes a free block
    (100, 0, 0, 0, 20, 0, 2),      # only a chunk of 20 allocated now
    (100, 0, 2, 0, 100, 4, 5),     # 68 + 4 lookahead slots: still 5 blocks
    (100, 0, 2, 0, 100, 13, 6),    # 68 + 13: 6
    (100, 50, 2, 0, 100, 0, 4),    # 50 computed (more than the hits): 50 left
])
def test_prompt_blocks(tokens, computed, hits, fresh, cap, lookahead, need):
    assert prompt_blocks(tokens, computed, hits, fresh, cap, lookahead, 16) == need


def test_prompt_blocks_names_a_bad_count():
    with pytest.raises(ValueError, match="fresh_hits=-1"):
        prompt_blocks(10, 0, 0, -1, 10, 0, 16)
    with pytest.raises(ValueError, match="block_size=0"):
        prompt_blocks(10, 0, 0, 0, 10, 0, 0)


def candidate_core(policy="peak"):
    """20 blocks of 4 tokens; running priorities 1, 3 and 5; a waiting priority 0 that
    may take all three's KV (queue_order "priority")."""
    core = make_core(policy, queue_order="priority")
    running = [add_running(core, prompt, 9, generated=1, priority=p)
               for prompt, p in ((31, 1), (11, 3), (11, 5))]
    waiting = add_waiting(core, 40, 8, priority=0)
    return core, running, waiting


def test_the_candidate_and_its_victims_least_important_first():
    core, (p1, p3, p5), waiting = candidate_core()
    planner = StepPlanner(core)
    assert planner.find_candidate(0) == (waiting, [p5, p3, p1])
    assert planner.candidate == waiting


def test_no_candidate_where_no_request_may_take_kv():
    core = make_core("peak")                       # fcfs, no flows
    add_running(core, 31, 9, generated=1)
    add_waiting(core, 40, 8)
    assert StepPlanner(core).find_candidate(0) == (-1, [])


@pytest.mark.parametrize("need,free,watermark,freed,kept,displaced", [
    (6, 2, 0, [3, 3, 10], [0, 0, 0], "53"),     # 2 + 3 < 6; 2 + 6 >= 6
    (6, 2, 0, [3, 3, 10], [2, 0, 0], "53"),     # a hit block is no gain: 2 + 1 + 3
    (6, 2, 0, [3, 3, 10], [2, 1, 0], "531"),    # 2 + 1 + 2 < 6: all three
    (6, 2, 0, [-1, 3, 10], [0, 0, 0], "31"),    # priority 5 cannot be freed now: passed over
    (20, 2, 0, [3, 3, 10], [0, 0, 0], ""),      # not even all of them: none
    (2, 2, 0, [3, 3, 10], [0, 0, 0], ""),       # not short: none
    (6, 2, 2, [3, 3, 10], [0, 0, 0], "53"),     # the watermark while another runs: 8 <= 8
    (6, 2, 5, [1, 1, 3], [0, 0, 0], "531"),     # 7 < 11 until none runs beside it: 7 >= 6
    (6, 2, 5, [1, 1, 1], [0, 0, 0], ""),        # 5 < 6 even with all three
])
def test_displacement_takes_the_fewest_victims_first_first(need, free, watermark, freed, kept,
                                                          displaced):
    core, (p1, p3, p5), waiting = candidate_core()
    planner = StepPlanner(core, watermark_blocks=watermark)
    planner.find_candidate(free)
    assert planner.is_short(need, free, 3) == (need + watermark > free)
    by_name = {"1": p1, "3": p3, "5": p5}
    assert planner.displace(free, 3, freed, kept) == [by_name[c] for c in displaced]


def test_displace_wants_one_entry_per_victim():
    core, _, _ = candidate_core()
    planner = StepPlanner(core)
    planner.find_candidate(0)
    planner.is_short(6, 2, 3)
    with pytest.raises(ValueError, match="one entry per victim"):
        planner.displace(2, 3, [3, 3], [0, 0])


@pytest.mark.parametrize("queue_order", ["fcfs", "priority"])
def test_the_pause_plan_is_the_cores(queue_order):
    """The planner's pause rows give the ShortfallPlanner's plan, priorities read only
    under queue_order "priority"."""
    rng = random.Random(7)
    core = make_core("auto", num_blocks=64, queue_order=queue_order)
    planner = StepPlanner(core, lookahead_tokens=2)
    for _ in range(200):
        n = rng.randint(1, 8)
        want = [rng.choice([0, 1, 1, 1, 17, 40]) for _ in range(n)]
        computed = [rng.randint(0, 60) for _ in range(n)]
        held = [-(-c // 4) for c in computed]
        prio = [rng.randint(0, 3) for _ in range(n)]
        free, budget = rng.randint(0, 12), rng.randint(1, 80)
        expected = core.plan_shortfall(want, computed, held, free, budget, 2,
                                       prio if queue_order == "priority" else None)
        assert planner.pause(want, computed, held, prio if queue_order == "priority" else None,
                             free, budget, [-1] * n) == expected


def test_pause_names_a_bad_row():
    planner = StepPlanner(make_core("auto"))
    with pytest.raises(ValueError, match="row 1"):
        planner.pause([1, 1], [4, -4], [1, 1], None, 3, 100, [-1, -1])
    with pytest.raises(ValueError, match="held: 1 entries"):
        planner.pause([1, 1], [4, 4], [1], None, 3, 100, [-1, -1])
    with pytest.raises(ValueError, match="slots: 1 entries"):
        planner.pause([1, 1], [4, 4], [1, 1], None, 3, 100, [-1])
    # slots are read (and checked) under shortfall "cost" only
    planner = StepPlanner(make_core("auto", shortfall="cost"))
    with pytest.raises(KeyError, match="slot 5"):
        planner.pause([1], [4], [1], None, 3, 100, [5])     # no such running request
