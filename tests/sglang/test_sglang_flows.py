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
