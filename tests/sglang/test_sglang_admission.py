"""Admission through SGLang's real PrefillAdder (hooked get_prefill_adder_class):
each policy admits or holds exactly as the kvadmit core decides, and the
outcomes differ from SGLang's own rule where the policies say they should."""
import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402

POLICIES = ["overcommit", "reserve", "peak", "predict", "adaptive"]


def harness(policy, pool=1000, **cfg):
    from sglang_harness import Harness

    config = None if policy is None else AdmissionConfig.from_dict({"policy": policy, **cfg})
    return Harness(config, pool_tokens=pool)


def bring_up(h, specs, generated):
    """Runs the requests until each has generated ``generated`` tokens."""
    from sglang_harness import make_req

    reqs = [make_req(rid, p, m, out_len=m) for rid, p, m in specs]
    for r in reqs:
        assert h.submit(r)
    for _ in range(10 * generated + 10):
        if all(len(r.output_ids) >= generated for r in reqs):
            break
        h.step()
    assert all(len(r.output_ids) == generated for r in reqs), [len(r.output_ids) for r in reqs]
    assert not h.sched.waiting_queue
    return reqs


def offer(h, prompt, max_new):
    """Submits a candidate and runs one step; True when it was admitted."""
    from sglang_harness import make_req

    cand = make_req("cand", prompt, max_new, out_len=max_new)
    assert h.submit(cand)
    expected = None
    if h.adapter is not None:
        # What the core says for this state (same inputs the adder will give it).
        h.adapter.begin_step(h.sched.running_batch, h.sched.last_batch, None, h.sched.waiting_queue)
        slot = h.adapter.slot_for(cand)
        cand.init_next_round_input(h.tree_cache)
        h.adapter.prepare_decision(slot, cand)
        free = h.allocator.available_size() + h.tree_cache.evictable_size()
        expected = h.adapter.port.core.decide(slot, free) == "admit"
    batch = h.step()
    admitted = batch is not None and any(r is cand for r in batch.reqs)
    assert admitted == (cand not in h.sched.waiting_queue)
    if h.adapter is not None:
        assert admitted == expected
        assert h.adapter.port.core.state(h.adapter.slot_for(cand)) == ("running" if admitted else "waiting")
    return admitted


# Two running requests near the end (generated 250 of 300, holding ~350 each,
# 700 of a 1000-token pool) and a candidate of 100 prompt + 300 new tokens.
NEAR_DONE = [("a", 100, 300), ("b", 100, 300)]


@pytest.mark.parametrize("policy, admitted", [
    (None, False),          # SGLang: 100 + 300 >= 300 free - 2 x 50 x ratio
    ("predict", False),     # the same rule, run by the core
    ("reserve", False),     # 2 x 400 + 400 > 1000
    ("peak", True),         # the running ones finish before the candidate peaks
    ("adaptive", True),     # as peak with max_new (no length history yet)
    ("overcommit", True),   # its prompt fits now
])
def test_near_done_running_set(kvadmit_hooks, policy, admitted):
    h = harness(policy)
    bring_up(h, NEAR_DONE, 250)
    assert offer(h, 100, 300) is admitted


@pytest.mark.parametrize("policy, admitted", [
    (None, True),           # SGLang with its ratio decayed to the floor: 2 x 390 x 0.098 reserved
    ("predict", False),     # the core's ratio is still at its initial 0.7
    ("reserve", False),
    ("peak", False),        # three requests growing to ~500 tokens each
    ("adaptive", False),
    ("overcommit", True),
])
def test_early_running_set(kvadmit_hooks, policy, admitted):
    h = harness(policy)
    bring_up(h, [("a", 100, 400), ("b", 100, 400)], 10)
    h.tracker.current = h.tracker.min  # SGLang's own ratio after long decode without retraction
    assert offer(h, 100, 400) is admitted


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("generated, prompt, max_new", [
    (5, 50, 100), (40, 300, 200), (120, 20, 600), (200, 150, 150),
])
def test_adder_follows_the_core(kvadmit_hooks, policy, generated, prompt, max_new):
    """Whatever the state, SGLang's adder admits the candidate iff the core says 'admit'."""
    h = harness(policy)
    bring_up(h, [("a", 120, 320), ("b", 60, 500)], generated)
    offer(h, prompt, max_new)  # asserts admitted == core decision


def test_queue_order_priority(kvadmit_hooks):
    from sglang_harness import make_req

    for low_first, expect in ((False, ["b", "c", "a"]), (True, ["a", "c", "b"])):
        from sglang_harness import Harness
        h = Harness(AdmissionConfig.from_dict({"queue_order": "priority"}),
                    low_priority_values_first=low_first)
        for rid, prio in (("a", 1), ("b", 5), ("c", 3)):
            assert h.submit(make_req(rid, 10, 10, priority=prio))
        assert [r.rid for r in h.sched.waiting_queue] == ["a", "b", "c"]  # SGLang's append order
        h.sched.get_prefill_adder_class()  # the hook puts the queue in the core's order
        assert [r.rid for r in h.sched.waiting_queue] == expect


@pytest.mark.parametrize("low_first", [False, True])
def test_queue_order_priority_ties_follow_sglangs_entry_time(kvadmit_hooks, low_first):
    """SGLang's priority scheduling sorts by (priority, wait_queue_entry_time), stamped
    as a request enters the waiting queue, which is when the core sees it arrive: among
    equal priorities the core's order is SGLang's own (no engine arrival time to take,
    unlike vLLM's Request.arrival_time)."""
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({"queue_order": "priority"}),
                low_priority_values_first=low_first)
    for i, prio in enumerate((2, 1, 2, 3, 1, 2, 1)):
        assert h.submit(make_req(f"r{i}", 10, 10, priority=prio))
    own = list(h.sched.waiting_queue)
    SchedulePolicy._sort_by_priority_and_fcfs(own, 1 if low_first else -1)
    h.sched.get_prefill_adder_class()   # the hook puts the queue in the core's order
    assert [r.rid for r in h.sched.waiting_queue] == [r.rid for r in own]


@pytest.mark.parametrize("head_of_line, admitted", [("strict", []), ("bypass", ["small"])])
def test_head_of_line(kvadmit_hooks, head_of_line, admitted):
    from sglang_harness import make_req

    h = harness("reserve", head_of_line=head_of_line)
    bring_up(h, [("a", 100, 500)], 5)             # reserves 600 of 1000
    big = make_req("big", 100, 400, out_len=400)  # 600 + 500 > 1000: held
    small = make_req("small", 50, 100, out_len=100)
    assert h.submit(big) and h.submit(small)
    batch = h.step()
    got = [] if batch is None or not batch.forward_mode.is_extend() else [r.rid for r in batch.reqs]
    assert got == admitted
    assert big in h.sched.waiting_queue
    assert h.adapter.port.core.stats()["held"]["hold_capacity"] >= 1


def test_ignore_eos_request_is_admitted_by_the_core(kvadmit_hooks):
    """SGLang's extra look-ahead for ignore_eos requests (radix cache off) is
    the core's job under kvadmit: the core's decision stands."""
    from sglang_harness import make_req

    h = harness("overcommit")
    h.tree_cache.disable = True  # SGLang takes its ignore_eos path only then
    bring_up(h, [("a", 100, 600)], 5)
    cand = make_req("cand", 100, 600, out_len=600, ignore_eos=True)
    assert h.submit(cand)
    batch = h.step()
    assert batch is not None and cand in batch.reqs
