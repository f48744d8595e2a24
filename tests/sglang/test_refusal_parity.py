"""The same refusal gets the same answer in both engines (issue 11 item 3): vLLM's
real scheduler in-process (its refused output turned into the HTTP error the
API-server patch raises) and SGLang's real queue path (the abort finish reason its
HTTP server answers with) give the same status, reason, Retry-After and message
shape, as kvadmit.protocol defines them."""
import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py
pytest.importorskip("vllm.v1")

from kvadmit import AdmissionConfig  # noqa: E402

CASES = {
    # a prompt larger than max_queued_tokens can never be queued: 400 (vLLM said 503)
    "prompt_over_token_cap": ({"max_queued_tokens": 100}, [(150, 10, None)]),
    "queue_full": ({"max_queued_requests": 1}, [(30, 20, None), (30, 20, None)]),
    # HAProxy's set-up (retry-on 503): the configured status, in both engines
    "queue_full_503": ({"max_queued_requests": 1, "overload_status": 503},
                       [(30, 20, None), (30, 20, None)]),
    "context_length": ({}, [(400, 200, None)]),
    "invalid_field": ({}, [(30, 10, {"ttft_slo_s": "soon"})]),
}


def vllm_answer(model_dir, cfg, requests):
    from kvadmit.protocol import Refusal
    from kvadmit.vllm import Scheduler
    from kvadmit.vllm.inprocess import InProcessEngine
    from kvadmit_patches.vllm_http_status import error_for

    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                          additional_config={"kvadmit": {"policy": "peak", **cfg}})
    ids = [eng.add([9] * p, m, extra_args={"kvadmit": f} if f else None) for p, m, f in requests]
    eng.run()
    last = ids[-1]
    err = error_for(Refusal.from_output(eng.log.stop_reasons[last],
                                        eng.log.kv_transfer_params.get(last)))
    retry = err.refusal.retry_after
    return int(err.http_status), err.refusal.reason, retry, err.message


def sglang_answer(cfg, requests):
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({"policy": "peak", **cfg}), pool_tokens=768,
                max_context=512)
    for i, (p, m, f) in enumerate(requests):
        h.submit(make_req(f"r{i}", p, m, custom_params={"kvadmit": f} if f else None))
    reason = h.outbox.sent[-1][0].finished_reason
    return (int(reason["status_code"]), reason["kvadmit_reason"], reason.get("retry_after"),
            reason["message"])


@pytest.mark.parametrize("case", list(CASES))
def test_same_refusal_same_answer(kvadmit_hooks, model_dir, case):
    cfg, requests = CASES[case]
    v_status, v_reason, v_retry, v_message = vllm_answer(model_dir, cfg, requests)
    s_status, s_reason, s_retry, s_message = sglang_answer(cfg, requests)
    assert (v_status, v_reason, v_retry) == (s_status, s_reason, s_retry), (v_message, s_message)
    assert v_message.startswith(f"kvadmit:{v_reason}: ") and s_message.startswith(f"kvadmit:{s_reason}: ")
    if v_status in (429, 503):
        assert v_retry >= 1 and v_message.endswith(f"(retry after {v_retry} s)")
    else:
        assert v_retry is None and v_message.endswith("(retrying will not help)")
        assert s_message.endswith("(retrying will not help)")
    expected = {"prompt_over_token_cap": 400, "queue_full": 429, "queue_full_503": 503,
                "context_length": 400, "invalid_field": 400}[case]
    assert v_status == expected
