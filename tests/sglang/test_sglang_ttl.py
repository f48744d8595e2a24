"""Stale work on SGLang's real scheduling classes: a waiting request past its TTL
(custom_params kvadmit ttl_s, or the config's max_queue_age_s) leaves SGLang's queue
with an abort carrying reason `expired` before it is ever prefilled; the others run."""
from http import HTTPStatus

from kvadmit import AdmissionConfig


def test_a_held_request_past_its_ttl_is_aborted_before_prefill(kvadmit_hooks):
    from sglang_harness import Harness, make_req

    # reserve: the long request's worst case holds 500 of the 600 tokens, so the two
    # behind it wait; 10 ms a step.
    h = Harness(AdmissionConfig.from_dict({"policy": "reserve", "max_queue_age_s": 30.0}),
                pool_tokens=600, step_model=(0.01, 0.0, 0.0))
    long = make_req("long", 100, 400, ignore_eos=True)
    stale = make_req("stale", 100, 200, custom_params={"kvadmit": {"ttl_s": 0.5}})
    patient = make_req("patient", 100, 200, out_len=5)
    h.run({0: [long], 1: [stale, patient]})
    (abort, req), = h.outbox.sent
    assert abort.rid == "stale" and req is stale
    reason = abort.finished_reason
    assert reason["kvadmit_reason"] == "expired" and reason["status_code"] == HTTPStatus.BAD_REQUEST
    assert "past its ttl_s=0.5 s: dropped before prefill" in reason["message"]
    assert "retry_after" not in reason
    assert len(stale.output_ids) == 0 and len(patient.output_ids) == 5 and long.finished()
    core = h.adapter.port.core
    assert core.stats()["rejected"]["expired"] == 1 and core.num_waiting == 0
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == 600
