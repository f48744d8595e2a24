"""What a request body can hold that would crash SGLang's scheduler further on,
refused at arrival (SGLang's real queue path, kvadmit's hooked queue-limit check):
a prompt token id outside the vocabulary (SGLang does not check input_ids; the
embedding lookup would index past its table) and a max_new_tokens beyond the
core's integers. 400 naming the field and the limit; the scheduler goes on."""
from array import array
from http import HTTPStatus

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402


def req_with(rid, ids, max_new=8):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_harness import EOS, VOCAB

    params = SamplingParams(max_new_tokens=max_new)
    params.normalize(None)
    req = Req(rid, "", array("q", ids), params, eos_token_ids={EOS}, vocab_size=VOCAB)
    req.kvadmit_test_out_len = 4
    return req


@pytest.mark.parametrize("ids, max_new, words", [
    ([5, 1000, 7], 8, "input_ids[1]=1000: outside the model's vocabulary [0, 1000)"),
    ([5, 99999], 8, "input_ids[1]=99999"),
    ([-1, 5], 8, "input_ids[0]=-1"),
    ([5, 6], 2 ** 63, "max_new_tokens=9223372036854775808: out of range [0, 2**62]"),
])
def test_a_body_the_model_would_crash_on_is_refused(kvadmit_hooks, ids, max_new, words):
    from sglang_harness import Harness

    h = Harness(AdmissionConfig.from_dict({"policy": "peak"}))
    assert not h.submit(req_with("bad", ids, max_new))
    (abort, _), = h.outbox.sent
    reason = abort.finished_reason
    assert reason["status_code"] == HTTPStatus.BAD_REQUEST
    assert reason["kvadmit_reason"] == "invalid" and words in reason["message"], reason
    assert h.adapter.stats()["rejected"]["invalid"] == 1
    ok = req_with("ok", [999] * 10)          # the vocabulary's last id is fine
    assert h.submit(ok)
    h.run()
    assert ok.finished() and len(ok.output_ids) == 4


def test_a_request_past_the_queue_hook_with_a_huge_count_does_not_crash(kvadmit_hooks):
    """A request SGLang queued by a path kvadmit did not see is adopted at the next
    step; numbers beyond the core's integers leave it untracked (SGLang serves it),
    instead of an OverflowError inside the scheduler."""
    from sglang_harness import Harness

    h = Harness(AdmissionConfig.from_dict({"policy": "peak"}))
    req = req_with("bypass", [5] * 10, 2 ** 63)
    h.sched.waiting_queue.append(req)
    h.run()
    assert req.finished() and len(req.output_ids) == 4
    assert h.adapter.stats()["untracked"] >= 1     # tried again each step it waits
