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
