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
    stats = h.adapter.port.core.flow_stats()
    assert stats["a"]["flow"] == flow_int("a") and stats["a"]["refused"] == 1
    assert (stats["a"]["admitted"], stats["7"]["admitted"]) == (1, 1)
    assert stats["a"]["kv_block_steps"] > 0 and stats["7"]["kv_block_steps"] > 0


def test_a_flow_within_its_share_evicts_a_flow_over_it(kvadmit_hooks):
    """Flow displacement on SGLang's real classes (it cannot pause): b's two running
    requests hold 360 of the 400 tokens (its share, with a live: 200); a's request
    (80 tokens) has no KV now. The core lets it take b's (a stays within its share, b
    without its latest still holds more than a): the adder evicts b's latest for it,
    a's request starts at once, and everything finishes with every token back. Without
    flows the same request waits for b's to finish."""
    from sglang_harness import Harness, make_req

    def run(flows):
        h = Harness(AdmissionConfig.from_dict({"policy": "overcommit",
                                               **({"flows": {"a": {}, "b": {}}} if flows else {})}),
                    pool_tokens=400)
        a, b = ({"kvadmit": {"flow": f}} if flows else {} for f in ("a", "b"))
        for rid, prompt in (("b1", 200), ("b2", 150)):
            assert h.submit(make_req(rid, prompt, 100, out_len=100, custom_params=b))
            h.step()
            h.step()
        a1 = make_req("a1", 80, 4, out_len=4, custom_params=a)
        assert h.submit(a1)
        h.step()
        started = len(a1.output_ids) > 0
        displaced = list(h.displaced)
        h.run()
        assert sorted(r.rid for r in h.finished) == ["a1", "b1", "b2"]
        assert h.allocator.available_size() + h.tree_cache.evictable_size() == 400
        return started, displaced, h.adapter.port.core.flow_stats(), h.adapter.port.core.stats()

    started, displaced, stats, totals = run(flows=True)
    assert started and displaced == ["b2"]
    assert stats["b"]["preempted"] >= 1 and stats["a"]["preempted"] == 0   # (overcommit: b retracts too)
    assert totals["displaced"] == 1     # b2's eviction; b's retractions count as preempted only
    started, displaced, *_ = run(flows=False)
    assert not started and displaced == []


def test_without_priority_preemption_flows_evict_no_sheddable_request(kvadmit_hooks):
    """With --enable-priority-scheduling and --disable-priority-preemption, flows take
    KV only within a request's class: b's running requests are sheddable, so a's
    protected request waits for them (with SGLang's preemption on, the core's priority
    retraction evicts the sheddable one for it)."""
    from sglang_harness import Harness, make_req

    def run(disable):
        h = Harness(AdmissionConfig.from_dict({"policy": "overcommit",
                                               "flows": {"a": {}, "b": {}}}),
                    pool_tokens=400, enable_priority_scheduling=True,
                    disable_priority_preemption=disable)
        b = {"kvadmit": {"flow": "b", "sheddable": True}}
        for rid, prompt in (("b1", 200), ("b2", 150)):
            assert h.submit(make_req(rid, prompt, 100, out_len=100, priority=5, custom_params=b))
            h.step()
            h.step()
        # priority 5 under SGLang's sign: protected (a negative one would be sheddable)
        a1 = make_req("a1", 80, 4, out_len=4, priority=5, custom_params={"kvadmit": {"flow": "a"}})
        assert h.submit(a1)
        h.step()
        started, displaced = len(a1.output_ids) > 0, list(h.displaced)
        h.run()
        assert sorted(r.rid for r in h.finished) == ["a1", "b1", "b2"]
        return started, displaced

    assert run(disable=True) == (False, [])
    started, displaced = run(disable=False)
    assert started and displaced
