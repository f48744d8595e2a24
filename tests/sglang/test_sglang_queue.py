"""Queue caps through the real Scheduler._add_request_to_queue (hooked
_abort_on_queued_limit): the client gets SGLang's usual abort output with
kvadmit's reason in the message."""
from http import HTTPStatus

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from sglang.srt.managers.io_struct import AbortReq  # noqa: E402

from kvadmit import AdmissionConfig  # noqa: E402


def harness(**cfg):
    from sglang_harness import Harness

    sglang_kwargs = {k: cfg.pop(k) for k in ("max_queued_requests_sglang",) if k in cfg}
    return Harness(AdmissionConfig.from_dict(cfg),
                   max_queued_requests=sglang_kwargs.get("max_queued_requests_sglang"))


def test_queue_full_aborts_with_kvadmit_reason(kvadmit_hooks):
    from sglang_harness import make_req

    h = harness(max_queued_requests=2)
    reqs = [make_req(f"q{i}", 30, 20) for i in range(3)]
    assert h.submit(reqs[0]) and h.submit(reqs[1])
    assert not h.submit(reqs[2])
    assert [r.rid for r in h.sched.waiting_queue] == ["q0", "q1"]
    (abort, req), = h.outbox.sent
    assert isinstance(abort, AbortReq) and abort.rid == "q2" and req is reqs[2]
    reason = abort.finished_reason
    assert reason["type"] == "abort"
    assert reason["status_code"] == HTTPStatus.TOO_MANY_REQUESTS   # the default overload_status
    assert reason["kvadmit_reason"] == "queue_full"
    assert "max_queued_requests=2" in reason["message"] and "retry after" in reason["message"]
    assert isinstance(reason["retry_after"], int) and reason["retry_after"] >= 1
    core = h.adapter.port.core
    assert core.num_waiting == 2 and core.stats()["rejected"]["queue_full"] == 1
    assert h.adapter.slot_for(reqs[2]) is None


def test_oversized_prompt_is_a_client_error(kvadmit_hooks):
    from sglang_harness import make_req

    h = harness(max_queued_tokens=100)
    assert not h.submit(make_req("big", 150, 10))
    (abort, _), = h.outbox.sent
    assert abort.finished_reason["status_code"] == HTTPStatus.BAD_REQUEST  # retrying cannot help
    assert abort.finished_reason["kvadmit_reason"] == "queued_tokens_full"
    assert "retry_after" not in abort.finished_reason


def test_priority_shedding_aborts_the_lowest(kvadmit_hooks):
    from sglang_harness import make_req

    h = harness(max_queued_requests=2, shed_lower_priority=True, queue_order="priority")
    # SGLang's default: a larger priority value is more important.
    assert h.submit(make_req("low", 30, 20, priority=1))
    assert h.submit(make_req("mid", 30, 20, priority=2))
    assert h.submit(make_req("high", 30, 20, priority=5))
    assert sorted(r.rid for r in h.sched.waiting_queue) == ["high", "mid"]
    (abort, req), = h.outbox.sent
    assert abort.rid == "low" and req.rid == "low"
    assert abort.finished_reason["kvadmit_reason"] == "shed"
    assert abort.finished_reason["status_code"] == HTTPStatus.TOO_MANY_REQUESTS
    # Lower than everything waiting: refused instead.
    assert not h.submit(make_req("lowest", 30, 20, priority=0))
    assert h.outbox.sent[-1][0].rid == "lowest"
    assert h.outbox.sent[-1][0].finished_reason["kvadmit_reason"] == "queue_full"
    assert h.adapter.port.core.num_waiting == 2


def test_sglang_own_cap_still_applies(kvadmit_hooks):
    """kvadmit accepts, SGLang's --max-queued-requests refuses: the core forgets it."""
    from sglang_harness import make_req

    h = harness(max_queued_requests_sglang=1)
    assert h.submit(make_req("a", 30, 20))
    assert not h.submit(make_req("b", 30, 20))
    (abort, _), = h.outbox.sent
    assert abort.finished_reason["message"] == "The request queue is full."
    assert h.adapter.port.core.num_waiting == 1 and h.adapter.port.core.stats()["aborted"] == 1


def test_without_kvadmit_sglang_cap_unchanged(kvadmit_hooks):
    from sglang_harness import Harness, make_req

    h = Harness(None, max_queued_requests=1)
    assert h.submit(make_req("a", 30, 20))
    assert not h.submit(make_req("b", 30, 20))
    (abort, _), = h.outbox.sent
    assert abort.finished_reason["message"] == "The request queue is full."
    assert "kvadmit_reason" not in abort.finished_reason


def test_aborted_while_waiting_leaves_the_ledger(kvadmit_hooks):
    """A request SGLang drops from the queue (client abort) leaves the core at the next step."""
    from sglang_harness import make_req

    h = harness(max_queued_requests=2)
    a, b = make_req("a", 30, 20), make_req("b", 30, 20)
    assert h.submit(a) and h.submit(b)
    h.sched.waiting_queue.remove(b)  # what Scheduler.abort_request does for a queued request
    h.step()
    assert h.adapter.slot_for(b) is None
    assert h.adapter.port.core.stats()["aborted"] == 1
    assert h.submit(make_req("c", 30, 20))  # room again
