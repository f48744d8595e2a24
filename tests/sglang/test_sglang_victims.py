"""Retraction victims: ScheduleBatch._get_decode_retraction_order (hooked) gives
the core's victim order, and SGLang's real retract_decode takes the core's
victim first."""
import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402

from kvadmit import AdmissionConfig  # noqa: E402


def running_set(victim, pool=4000):
    """Four running requests admitted one per step (different admission order,
    prompt lengths, priorities and progress)."""
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({"policy": "overcommit", "victim": victim}),
                pool_tokens=pool)
    specs = [("r0", 300, 800, 0), ("r1", 40, 800, 7), ("r2", 200, 800, 3), ("r3", 90, 800, 5)]
    reqs = []
    for rid, prompt, max_new, prio in specs:
        req = make_req(rid, prompt, max_new, out_len=max_new, priority=prio)
        assert h.submit(req)
        reqs.append(req)
        for _ in range(3):  # one prefill, then a few decodes: progress differs
            h.step()
    h.step()
    batch = h.sched.running_batch
    assert sorted(r.rid for r in batch.reqs) == ["r0", "r1", "r2", "r3"]
    return h, batch


def sglang_default_order(reqs):
    # SGLang 0.5.23's default ("length"): keep the most generated, then the shortest prompt.
    return sorted(range(len(reqs)), key=lambda i: (len(reqs[i].output_ids),
                                                   -len(reqs[i].origin_input_ids)), reverse=True)


@pytest.mark.parametrize("victim", ["lifo", "length", "lcf", "priority"])
def test_order_is_the_cores(kvadmit_hooks, victim):
    h, batch = running_set(victim)
    order = batch._get_decode_retraction_order(batch.reqs)  # as retract_decode calls it
    slots = [h.adapter.slot_for(batch.reqs[i]) for i in order]
    assert slots == h.adapter.port.core.victim_order()
    assert slots[-1] == h.adapter.port.core.victim()


def test_lifo_takes_the_last_admitted(kvadmit_hooks):
    h, batch = running_set("lifo")
    order = ScheduleBatch._get_decode_retraction_order(batch.reqs)
    assert [batch.reqs[i].rid for i in order] == ["r0", "r1", "r2", "r3"]  # r3 goes first


def test_priority_victim_uses_sglang_priorities(kvadmit_hooks):
    # SGLang's default: a larger priority value is more important, so r0 (0) goes first.
    h, batch = running_set("priority")
    order = ScheduleBatch._get_decode_retraction_order(batch.reqs)
    assert [batch.reqs[i].rid for i in order] == ["r1", "r3", "r2", "r0"]
    assert order != sglang_default_order(batch.reqs)  # SGLang would retract r3 first


@pytest.mark.parametrize("victim", ["lifo", "length", "lcf", "priority"])
def test_retract_decode_takes_the_cores_victim(kvadmit_hooks, victim):
    from sglang.srt.managers.scheduler import Scheduler

    h, batch = running_set(victim)
    core = h.adapter.port.core
    expected = h.adapter.port.key(core.victim())
    # Use up the pool so the next decode step does not fit.
    assert h.tree_cache.evictable_size() == 0
    taken = h.allocator.alloc(h.allocator.available_size())
    assert taken is not None
    assert not batch.check_decode_mem()
    retracted, _, aborted = batch.retract_decode()
    assert not aborted and retracted, "retract_decode retracted nothing"
    assert retracted[0].rid == expected
    for req in retracted:
        Scheduler._add_request_to_queue(h.sched, req, is_retracted=True)
    assert core.state(h.adapter.slot_for(retracted[0])) == "waiting"
    assert core.stats()["preempted"] == len(retracted)
    h.allocator.free(taken)


def test_untracked_requests_fall_back_to_sglang(kvadmit_hooks):
    """A batch none of whose requests kvadmit tracks keeps SGLang's own order."""
    from sglang_harness import Harness, make_req

    h = Harness(None, pool_tokens=4000)
    for rid, p in (("x", 50), ("y", 300), ("z", 120)):
        assert h.submit(make_req(rid, p, 400, out_len=400))
    for _ in range(4):
        h.step()
    reqs = h.sched.running_batch.reqs
    assert ScheduleBatch._get_decode_retraction_order(reqs) == sglang_default_order(reqs)
