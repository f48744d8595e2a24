"""The flow field through SGLang's real request path (custom_params["kvadmit"]["flow"]):
it reaches the core, a flow's own cap refuses naming the flow (the abort's message),
and the flows' stats count what SGLang ran."""
import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402
from kvadmit.request_fields import flow_int  # noqa: E402


def test_the_flow_field_reaches_the_core_and_its_cap_names_it(kvadmit_hooks):
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({"policy": "peak",
                                           "flows": {"a": {"max_queued_requests": 1}}}),
                pool_tokens=2048)
    assert h.submit(make_req("a1", 50, 8, custom_params={"kvadmit": {"flow": "a"}}))
    assert not h.submit(make_req("a2", 50, 8, custom_params={"kvadmit": {"flow": "a"}}))
    (abort, _), = h.outbox.sent
    assert abort.finished_reason["kvadmit_reason"] == "queue_full"
    assert "(flow 'a')" in abort.finished_reason["message"]
    assert h.submit(make_req("b1", 50, 8, custom_params={"kvadmit": {"flow": "7"}}))
    h.run()
    stats = h.adapter.core.flow_stats()
    assert stats["a"]["flow"] == flow_int("a") and stats["a"]["refused"] == 1
    assert (stats["a"]["admitted"], stats["7"]["admitted"]) == (1, 1)
    assert stats["a"]["kv_block_steps"] > 0 and stats["7"]["kv_block_steps"] > 0


def test_a_flows_headroom_hold_leaves_the_batch_open_for_another_flow(kvadmit_hooks):
    """A request held only by the flows' headroom (its flow holds more than another live
    flow below its share: kvadmit._flows.c_headroom) does not mark SGLang's batch full
    (NO_TOKEN), so the quiet flow's next request starts on the next step, not after a
    running request finishes."""
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({"policy": "reserve", "flows": {"a": {}, "b": {}}}),
                pool_tokens=400)
    a, b = {"kvadmit": {"flow": "a"}}, {"kvadmit": {"flow": "b"}}
    h.submit(make_req("a0", 8, 4, out_len=4, custom_params=a))
    for _ in range(8):
        h.step()                     # a0 finished: a's requests hold 12 tokens
    h.submit(make_req("a1", 8, 100, out_len=100, custom_params=a))    # reserves 108
    h.submit(make_req("b1", 50, 100, out_len=100, custom_params=b))   # reserves 150
    h.step()
    h.step()
    core = h.adapter.core
    # b2 reserves 130: 388 of the 400 fit, not the 400 - 4 x 12 b must leave a
    b2 = make_req("b2", 30, 100, out_len=100, custom_params=b)
    h.submit(b2)
    h.step()
    stats = core.flow_stats()
    assert stats["b"]["admitted"] == 1 and stats["b"]["waiting"] == 1
    slot = h.adapter.slot_for(b2)
    free = int(h.allocator.available_size())
    assert core.decide(slot, free, flows_headroom=False) == "admit"
    assert core.decide(slot, free) == "hold_capacity"
    assert not h.sched.running_batch.batch_is_full
    h.submit(make_req("a2", 8, 4, out_len=4, custom_params=a))
    h.step()
    assert core.flow_stats()["a"]["admitted"] == 3      # a2 started at once
    h.run()
    assert len(h.finished) == 5
