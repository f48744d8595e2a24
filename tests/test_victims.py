"""Victim rules: exact choices and deterministic ties."""
import pytest

from helpers import add_running, make_core


def build(victim):
    core = make_core("overcommit", num_blocks=1000, victim=victim)
    # (prompt, max_new, generated, priority), admitted in this order.
    rows = [(10, 50, 5, 1), (30, 50, 2, 2), (20, 50, 2, 2), (5, 50, 9, 0)]
    slots = [add_running(core, p, m, g, priority=pr) for p, m, g, pr in rows]
    return core, slots


@pytest.mark.parametrize("victim,order", [
    ("lifo", [0, 1, 2, 3]),            # last admitted goes first
    # priority: highest value first; among 1 and 2 (priority 2) the less computed (2: 21 < 31).
    ("priority", [3, 0, 1, 2]),
    # lcf: least computed tokens (prompt + generated - 1): 14, 31, 21, 13.
    ("lcf", [1, 2, 0, 3]),
    # length: fewest generated, then longest prompt: 1 (2 gen, 30) before 2 (2 gen, 20).
    ("length", [3, 0, 2, 1]),
])
def test_victim_order(victim, order):
    core, slots = build(victim)
    assert core.victim_order() == [slots[i] for i in order]
    assert core.victim() == slots[order[-1]]


def test_ties_break_by_arrival():
    core = make_core("overcommit", num_blocks=1000, victim="lcf")
    a = add_running(core, 10, 10)
    b = add_running(core, 10, 10)
    assert core.victim() == b          # same computed: the later arrival goes first
    core2 = make_core("overcommit", num_blocks=1000, victim="lcf")
    a2 = add_running(core2, 10, 10)
    b2 = add_running(core2, 10, 10)
    assert (a2, b2) == (a, b) and core2.victim_order() == core.victim_order()


def test_no_running_no_victim():
    assert make_core().victim() == -1
