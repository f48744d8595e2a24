"""kvadmit failing inside SGLang's scheduler fails open, as in vLLM (docs/sglang.md,
"When kvadmit itself fails"): a fault injected here at a chosen point of kvadmit's code,
on SGLang's real scheduling classes under load (tests/sglang/sglang_harness.py), is
logged once and counted, every hook takes its stock branch from then on, and every
request finishes with its whole output, none refused, every KV slot back."""
import logging

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402
from kvadmit.sglang.adapter import SGLangAdmission  # noqa: E402
from helpers import fail_on_call  # noqa: E402

POOL = 1500


@pytest.mark.parametrize("where, n", [("step", 40), ("prepare_decision", 30), ("on_enqueue", 20),
                                      ("retraction_order", 1)],
                         ids=["before-a-step", "choosing", "on-arrival", "retracting"])
def test_a_fault_fails_open_and_nothing_is_lost(kvadmit_hooks, monkeypatch, caplog, where, n):
    from sglang_harness import Harness, make_req

    calls = fail_on_call(monkeypatch, SGLangAdmission, where, n)
    # overcommit: SGLang's pool runs dry and retracts, so every hook is reached
    h = Harness(AdmissionConfig.from_dict({"policy": "overcommit"}), pool_tokens=POOL,
                max_running=16, max_context=1024)
    plan, sent = {}, []
    for i in range(60):
        req = make_req(f"r{i}", 40 + (37 * i) % 200, 400, out_len=60 + (53 * i) % 300)
        plan.setdefault(2 * i, []).append(req)
        sent.append(req)
    with caplog.at_level(logging.ERROR, logger="kvadmit.sglang"):
        h.run(plan)
    assert len(calls) >= n, "the fault point was never reached"
    assert h.adapter.failed and h.adapter.internal_errors == 1
    assert sum("failing open" in r.getMessage() for r in caplog.records) == 1
    assert not h.outbox.aborts()                                # nothing refused
    for req in sent:
        assert req.finished() and len(req.output_ids) == req.kvadmit_test_out_len, req.rid
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == POOL


@pytest.mark.parametrize("where, n", [("step", 40), ("prepare_decision", 30), ("on_enqueue", 20),
                                      ("retraction_order", 1), ("end_step", 25)],
                         ids=["before-a-step", "choosing", "on-arrival", "retracting",
                              "after-a-step"])
def test_a_fault_fails_closed_refusing_the_held_and_new_and_finishing_the_running(
        kvadmit_hooks, monkeypatch, caplog, where, n):
    """on_internal_error: closed. From the step of the fault on, no request that never
    started waits in SGLang's queue: each is aborted with kvadmit:failed_closed (503,
    no retry_after), as is every later arrival; every request that had started (the
    running, the retracted) finishes with its whole output; every KV slot comes back."""
    from sglang_harness import Harness, make_req

    calls = fail_on_call(monkeypatch, SGLangAdmission, where, n)
    h = Harness(AdmissionConfig.from_dict({"policy": "overcommit", "on_internal_error": "closed"}),
                pool_tokens=POOL, max_running=16, max_context=1024)
    s = h.sched
    plan, sent = {}, []
    for i in range(60):
        req = make_req(f"r{i}", 40 + (37 * i) % 200, 400, out_len=60 + (53 * i) % 300)
        plan.setdefault(2 * i, []).append(req)
        sent.append(req)
    steps, failed_at = 0, None
    with caplog.at_level(logging.ERROR, logger="kvadmit.sglang"):
        while plan or s.waiting_queue or not s.running_batch.is_empty() or s.chunked_req:
            for req in plan.pop(steps, ()):
                h.submit(req)
            h.step()
            steps += 1
            if failed_at is None and h.adapter.failed:
                failed_at = steps
            if failed_at is not None:   # within the step of the fault: none held any more
                assert not [r.rid for r in s.waiting_queue if not r.output_ids], steps
            assert steps < 20_000
        h.step()
    assert len(calls) >= n and failed_at is not None, "the fault point was never reached"
    assert h.adapter.failed_closed and h.adapter.internal_errors == 1
    assert sum("failing closed" in r.getMessage() for r in caplog.records) == 1
    aborted = {o.rid: o.finished_reason for o in h.outbox.aborts()}
    assert aborted and all(a["kvadmit_reason"] == "failed_closed" and a["status_code"] == 503
                           and "retry_after" not in a and "restarted" in a["message"]
                           for a in aborted.values()), aborted
    for req in sent:
        if req.rid in aborted:
            assert not req.output_ids, req.rid            # refused before its first token
        else:
            assert req.finished() and len(req.output_ids) == req.kvadmit_test_out_len, req.rid
    assert len(aborted) < len(sent)                       # some had started: they finished
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == POOL
    # it goes on: a new arrival is refused at once
    late = make_req("late", 50, 40)
    assert not h.submit(late) and aborted.keys() < {o.rid for o in h.outbox.aborts()}
