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
    assert (STATUS_KEY in r.to_params()) == (retry_after_s is not None and overload_status == 429)


def test_a_bad_overload_status_is_refused_and_a_stray_one_read_as_503():
    with pytest.raises(ValueError, match="overload_status=500"):
        Refusal("shed", "m", 1.0, 500)
    stray = Refusal.from_output("kvadmit:shed", {RETRY_AFTER_KEY: 1.0, STATUS_KEY: 500})
    assert stray.status == 503


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
