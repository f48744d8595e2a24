"""kvadmit.protocol without any engine: the reasons are the core's, and what a client
is told (status, message, Retry-After) survives the trip through a vLLM output's
kv_transfer_params."""
import pytest

from kvadmit import REJECT_REASONS
from kvadmit.protocol import (REASONS, RETRY_AFTER_KEY, STATUS_KEY, Refusal, retry_after_header,
                              sample_group, samples_marker)


def test_the_reasons_are_the_cores():
    assert set(REASONS) == set(REJECT_REASONS)


def test_the_reasons_come_from_the_native_gate_alone():
    """One list of reasons, the arrival gate's: the protocol takes it (same object, same
    order), the package re-exports it, and the core's per-reason counters (its C enum,
    N_REJECT_REASONS) count exactly those."""
    from kvadmit import AdmissionConfig, AdmissionCore, _arrival_gate, protocol
    assert protocol.REJECT_REASONS is _arrival_gate.REJECT_REASONS is REJECT_REASONS
    assert tuple(REASONS) == REJECT_REASONS and len(set(REJECT_REASONS)) == len(REJECT_REASONS)
    core = AdmissionCore(AdmissionConfig(), 64, 16, 0)
    assert tuple(core.stats()["rejected"]) == REJECT_REASONS
    assert all(isinstance(REASONS[r].message, str) and REASONS[r].message for r in REJECT_REASONS)


@pytest.mark.parametrize("retry_after_s, overload_status, status, header", [
    (2.2, 503, 503, 3), (0.2, 429, 429, 1), (None, 503, 400, None), (None, 429, 400, None)])
def test_status_and_retry_after(retry_after_s, overload_status, status, header):
    r = Refusal("queue_full", "3 waiting, max_queued_requests=3", retry_after_s, overload_status)
    assert r.status == status and r.retry_after == header
    tail = f"(retry after {header} s)" if header else "(retrying will not help)"
    assert r.client_message() == f"kvadmit:queue_full: 3 waiting, max_queued_requests=3 {tail}"
    back = Refusal.from_output(r.stop_reason, r.to_params())
    assert (back.reason, back.message, back.retry_after_s, back.status) == \
        (r.reason, r.message, r.retry_after_s, status)
    # a retryable refusal names its status on the trip, whichever it is
    assert r.to_params().get(STATUS_KEY) == (overload_status if retry_after_s is not None else None)


def test_a_refusal_without_a_status_has_the_configs_default():
    """One default for a retryable refusal's status, the config's (429): a Refusal built
    without one, one from a bare core Rejection, and one read back from a vLLM output
    that names none; 503 only where given."""
    from kvadmit import AdmissionConfig, Rejection
    from kvadmit.protocol import DEFAULT_OVERLOAD_STATUS
    assert DEFAULT_OVERLOAD_STATUS == AdmissionConfig().overload_status == 429
    assert Refusal("queue_full", "m", 1.0).status == 429
    assert Refusal.of(Rejection("queue_full", "m", "max_queued_requests", 1, 1.0)).status == 429
    assert Refusal.from_output("kvadmit:queue_full", {RETRY_AFTER_KEY: 1.0}).status == 429
    assert Refusal("queue_full", "m", 1.0, 503).status == 503
    assert Refusal("context_length", "m").status == 400      # not retryable: 400 either way


def test_a_bad_overload_status_is_refused_and_a_stray_one_read_as_the_default():
    with pytest.raises(ValueError, match="overload_status=500"):
        Refusal("shed", "m", 1.0, 500)
    stray = Refusal.from_output("kvadmit:shed", {RETRY_AFTER_KEY: 1.0, STATUS_KEY: 500})
    assert stray.status == 429


def test_outputs_that_are_not_kvadmit_refusals():
    assert Refusal.from_output("length", None) is None and Refusal.from_output(None, {}) is None
    unknown = Refusal.from_output("kvadmit:other", None)
    assert unknown.message == "refused by kvadmit" and not unknown.retryable


def test_retry_after_header_is_whole_seconds_at_least_one():
    assert [retry_after_header(s) for s in (None, 0.0, 0.01, 1.0, 1.01)] == [None, 1, 1, 1, 2]


def test_samples_are_grouped_only_by_their_own_ids():
    marker = samples_marker(3, "req-7")
    assert sample_group("1_req-7", marker) == ("req-7", 3)
    assert sample_group("3_req-7", marker) is None            # index beyond n
    assert sample_group("1_other", marker) is None            # not this parent's sample
    assert sample_group("1_req-7", {}) is None and sample_group("1_req-7", None) is None


@pytest.mark.parametrize("settings, status", [({}, 429), ({"overload_status": 503}, 503)])
def test_every_refusal_a_client_sees_has_the_configs_overload_status(settings, status):
    """429 by default (issue 44: vllm-router and SMG count a 5xx against a worker's
    breaker, a 429 not), 503 when configured (HAProxy's `retry-on 503`): the port's
    refusals carry it, through a vLLM output's kv_transfer_params as well, and so does
    SGLang's finish reason, also for a bare core `Rejection` given the config's status."""
    from kvadmit import AdmissionConfig, AdmissionCore, Rejection
    from kvadmit.arrival import ArrivalRecord
    from kvadmit.port import CorePort
    from kvadmit.sglang.request import rejection_finish_reason

    config = AdmissionConfig.from_dict({"max_queued_requests": 1, **settings})
    assert config.overload_status == status
    port = CorePort(AdmissionCore(config, 64, 16, 0))
    first = port.arrive("a", object(), lambda: ArrivalRecord(32, 8), 0.0)
    assert first.accepted
    refused = port.arrive("b", object(), lambda: ArrivalRecord(32, 8), 0.0)
    assert not refused.accepted and refused.refusal.reason == "queue_full"
    refusal = refused.refusal
    assert refusal.retryable and refusal.status == status
    back = Refusal.from_output(refusal.stop_reason, refusal.to_params())
    assert back.status == status
    assert rejection_finish_reason(refusal)["status_code"] == status
    # A bare Rejection (no Refusal built by the port): the config's status when given,
    # else the config's default, 429.
    bare = Rejection("queue_full", "m", "max_queued_requests", 1, 1.0)
    assert rejection_finish_reason(bare, config.overload_status)["status_code"] == status
    assert rejection_finish_reason(bare)["status_code"] == 429
    final = Rejection("context_length", "m", "max_model_len", 512, None)
    assert rejection_finish_reason(final, config.overload_status)["status_code"] == 400


def test_failed_closed_is_the_adapters_own_503_without_retry_after():
    """The refusal of every request once kvadmit failed closed: not the core's reason
    (its stats keep their keys), always 503 whatever overload_status says, no
    Retry-After, a message that names the state and the restart; it survives the trip
    through a vLLM output's kv_transfer_params."""
    from kvadmit.protocol import ADAPTER_REASONS, FAILED_CLOSED, RETRY_HINT_RE, failed_closed
    assert FAILED_CLOSED in ADAPTER_REASONS and FAILED_CLOSED not in REJECT_REASONS
    r = failed_closed()
    assert (r.reason, r.status, r.retry_after, r.retryable) == (FAILED_CLOSED, 503, None, False)
    assert Refusal(FAILED_CLOSED, r.message, None, 429).status == 503
    text = r.client_message()
    assert text.startswith("kvadmit:failed_closed: kvadmit failed inside this engine")
    assert "restarted" in text and text.endswith("(retry on another instance)")
    assert not RETRY_HINT_RE.search(text.encode())        # no Retry-After header from it
    back = Refusal.from_output(r.stop_reason, r.to_params())
    assert back == r and back.status == 503 and back.client_message() == text
    assert RETRY_AFTER_KEY not in r.to_params() and STATUS_KEY not in r.to_params()
