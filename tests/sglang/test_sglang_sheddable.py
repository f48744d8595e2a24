"""Sheddable traffic on SGLang's real scheduling classes: under
--enable-priority-scheduling with SGLang's own sign (a larger value more important,
as GIE's) a negative priority is sheddable, and so is a request with custom_params
kvadmit sheddable; while a request that is not sheddable waits for KV, a sheddable
one leaves SGLang's queue with an abort carrying reason `shed` (retryable) before it
is ever prefilled, and the others run."""
from http import HTTPStatus

import pytest

from kvadmit import AdmissionConfig


@pytest.mark.parametrize("how", ["negative_priority", "field"])
def test_a_sheddable_request_is_dropped_while_another_waits_for_kv(kvadmit_hooks, how):
    from sglang_harness import Harness, make_req

    prio = how == "negative_priority"
    # reserve: the long request's worst case holds 500 of the 600 tokens, so the two
    # behind it wait.
    h = Harness(AdmissionConfig.from_dict({"policy": "reserve"}), pool_tokens=600,
                step_model=(0.01, 0.0, 0.0), enable_priority_scheduling=prio)
    long = make_req("long", 100, 400, ignore_eos=True, priority=0 if prio else None)
    batch = make_req("batch", 50, 20, out_len=5, priority=-1 if prio else None,
                     custom_params=None if prio else {"kvadmit": {"sheddable": True}})
    chat = make_req("chat", 100, 200, out_len=5, priority=0 if prio else None)
    h.run({0: [long], 1: [batch, chat]})
    (abort, req), = h.outbox.sent
    assert abort.rid == "batch" and req is batch
    reason = abort.finished_reason
    assert reason["kvadmit_reason"] == "shed"
    assert reason["status_code"] == HTTPStatus.TOO_MANY_REQUESTS and reason["retry_after"] > 0
    assert "sheddable: dropped from the queue while requests that are not sheddable" \
        in reason["message"]
    assert len(batch.output_ids) == 0 and len(chat.output_ids) == 5 and long.finished()
    core = h.adapter.port.core
    assert core.stats()["rejected"]["shed"] == 1 and core.num_waiting == 0
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == 600


def test_negative_priority_is_not_sheddable_where_lower_values_come_first(kvadmit_hooks):
    from sglang_harness import Harness, make_req

    # --schedule-low-priority-values-first: -1 is the more important, never sheddable
    h = Harness(AdmissionConfig.from_dict({"policy": "reserve"}), pool_tokens=600,
                step_model=(0.01, 0.0, 0.0), enable_priority_scheduling=True,
                low_priority_values_first=True)
    long = make_req("long", 100, 400, ignore_eos=True, priority=0)
    first = make_req("first", 50, 20, out_len=5, priority=-1)
    chat = make_req("chat", 100, 200, out_len=5, priority=0)
    h.run({0: [long], 1: [first, chat]})
    assert h.outbox.sent == []
    assert len(first.output_ids) == 5 and len(chat.output_ids) == 5


def test_a_request_without_priority_is_not_sheddable(kvadmit_hooks):
    from sglang_harness import Harness, make_req

    # Under --enable-priority-scheduling SGLang gives a request without a priority its
    # least important value before kvadmit sees it: it is served last, never shed.
    h = Harness(AdmissionConfig.from_dict({"policy": "reserve"}), pool_tokens=600,
                step_model=(0.01, 0.0, 0.0), enable_priority_scheduling=True)
    long = make_req("long", 100, 400, ignore_eos=True, priority=0)
    unset = make_req("unset", 50, 20, out_len=5, priority=None)
    chat = make_req("chat", 100, 200, out_len=5, priority=0)
    h.run({0: [long], 1: [unset, chat]})
    assert h.outbox.sent == []
    assert len(unset.output_ids) == 5 and len(chat.output_ids) == 5
    assert h.adapter.port.core.stats()["rejected"]["shed"] == 0
