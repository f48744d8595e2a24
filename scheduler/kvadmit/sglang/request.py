"""One SGLang request in the core's terms, and a kvadmit refusal in SGLang's.

Per-request settings (`kvadmit.request_fields`, as for vLLM) come from
SGLang's ``custom_params`` under the key ``"kvadmit"`` (`parse_request_params`);
with the request's own numbers (prompt, max_new_tokens, priority) they make the
core's arrival record (`arrival_record`). A refusal goes back to SGLang as an
abort's finish reason (`rejection_finish_reason`).

Imports no SGLang: the functions read a ``Req``'s attributes.
"""
from __future__ import annotations

import sys
from typing import Mapping

from kvadmit import AdmissionConfig, request_fields
from kvadmit.arrival import ArrivalRecord, prompt_hash
from kvadmit.protocol import DEFAULT_OVERLOAD_STATUS, Refusal

# Priorities are clamped so that negating them (SGLang's "higher value first"
# default) stays inside int64; SGLang itself uses +/-sys.maxsize as sentinels.
_PRIORITY_LIMIT = (1 << 62) - 1
# What SGLang's Scheduler._set_or_validate_priority gives a request without a priority
# under --enable-priority-scheduling (a larger value more important): its least.
UNSET_PRIORITY = -sys.maxsize - 1

# Per-request settings: SamplingParams.custom_params["kvadmit"] (the /generate
# body's sampling_params.custom_params, or the OpenAI body's custom_params).
PARAMS_KEY = request_fields.KEY


def rejection_finish_reason(refusal, overload_status: int | None = None) -> dict:
    """SGLang's abort finish-reason dict for a kvadmit refusal (a `Refusal`, or the
    core's `Rejection`): status and message as `kvadmit.protocol` defines them for
    both engines (the config's ``overload_status``, 429 by default or 503, when
    retrying can help, else 400); ``retry_after`` (whole seconds) rides along for
    streaming clients, who read the finish reason itself. A `Refusal` (what the
    adapter sends, built by `kvadmit.port.CorePort` with the config's status) keeps
    its own status; a bare `Rejection` gets ``overload_status``, the config default
    (`kvadmit.protocol.DEFAULT_OVERLOAD_STATUS`, 429) when not given."""
    if not isinstance(refusal, Refusal):
        refusal = Refusal.of(refusal, DEFAULT_OVERLOAD_STATUS if overload_status is None
                             else overload_status)
    reason = {
        "type": "abort",
        "status_code": refusal.status,
        "message": refusal.client_message(),
        "kvadmit_reason": refusal.reason,
    }
    if refusal.retryable:
        reason["retry_after"] = refusal.retry_after
    return reason


def parse_request_params(custom_params, now_unix: float,
                         default_session=None) -> request_fields.RequestFields:
    """The kvadmit fields of a request: ``custom_params["kvadmit"]`` (an object
    of `kvadmit.request_fields` fields, validated there; ``deadline_s`` is
    checked against ``now_unix``). ``default_session``: SGLang's own session
    id of the request, the session when the fields name none.
    Raises `kvadmit.request_fields.FieldError` naming a malformed field."""
    raw = custom_params.get(PARAMS_KEY) if isinstance(custom_params, dict) else None
    fields = request_fields.NONE
    if raw is not None:
        if not isinstance(raw, Mapping):
            raise request_fields.FieldError(
                f"custom_params.{PARAMS_KEY}={raw!r}: must be an object of kvadmit fields "
                f"({', '.join(request_fields.FIELDS)})")
        if raw:
            names = {k: f"custom_params.{PARAMS_KEY}.{k}" for k in raw}
            fields = request_fields.parse(raw, now_unix, names)
    if fields.session < 0 and default_session is not None:
        try:
            fields = fields._replace(
                session=request_fields.session_int(default_session, "session_id"))
        except request_fields.FieldError:
            pass  # not a usable id (e.g. empty): no session
    return fields


def _sglang_session(req):
    """SGLang's own session id of a request (radix-native or session_params), or None."""
    sid = getattr(req, "session_id", None)
    if sid is None:
        sid = getattr(getattr(req, "session", None), "session_id", None)
    return sid if isinstance(sid, (str, int)) and not isinstance(sid, bool) else None


def core_priority(req, low_priority_values_first: bool) -> int:
    """The request's priority as the core orders it (lower first): SGLang's, clamped,
    and negated under SGLang's default (a higher value more important)."""
    p = req.priority if req.priority is not None else 0
    p = max(-_PRIORITY_LIMIT, min(_PRIORITY_LIMIT, int(p)))
    return p if low_priority_values_first else -p


def max_new_tokens_of(req) -> int:
    """The output tokens the core counts for a request: its max_new_tokens, 0 for an
    embedding (or other prefill-only) request, which SGLang gives max_new_tokens 0 and
    never decodes: admitted on its prompt alone."""
    m = req.sampling_params.max_new_tokens
    return max(int(m), 0) if m is not None else 1


def arrival_record(req, now: float, strict: bool, config: AdmissionConfig,
                   low_priority_values_first: bool, vocab_size: int) -> ArrivalRecord:
    """The core's arrival record of an SGLang request at ``now`` (the adapter's
    clock). ``strict``: a malformed kvadmit field or request body raises FieldError
    (naming it); else the fields fall back to the defaults."""
    try:
        _check_body(req, vocab_size)
        fields = parse_request_params(req.sampling_params.custom_params, now,
                                      _sglang_session(req))
    except request_fields.FieldError:
        if strict:
            raise
        fields = request_fields.NONE
    columns = request_fields.record_columns(fields, _ttft_target(fields, config, now))
    columns["sheddable"] = (fields.sheddable
                            or _negative_priority(req, config, low_priority_values_first))
    return ArrivalRecord(prompt_tokens=len(req.origin_input_ids),
                         max_new_tokens=max_new_tokens_of(req),
                         priority=core_priority(req, low_priority_values_first),
                         prompt_hash=prompt_hash(req.origin_input_ids), **columns)


def _negative_priority(req, config: AdmissionConfig, low_priority_values_first: bool) -> bool:
    """GIE's sheddable class, a negative priority the client gave, where SGLang's
    order is GIE's (priority scheduling on, a larger value more important:
    SGLang's default). A request without one is not sheddable: SGLang fills in
    its least important value, UNSET_PRIORITY, before kvadmit sees it."""
    return (config.queue_order == "priority" and not low_priority_values_first
            and req.priority is not None and UNSET_PRIORITY < req.priority < 0)


def _check_body(req, vocab_size: int) -> None:
    """Refuses (FieldError) what would crash the scheduler further on: a prompt token
    id outside the vocabulary (SGLang does not check input_ids; ``vocab_size`` 0:
    unknown) and a max_new_tokens beyond the core's integers."""
    request_fields.check_prompt_tokens(req.origin_input_ids, vocab_size, "input_ids",
                                       multimodal=req.multimodal_inputs is not None)
    m = req.sampling_params.max_new_tokens
    if m is not None:
        request_fields.check_int(m, "max_new_tokens", 0)


def _ttft_target(fields, config: AdmissionConfig, now: float) -> float:
    """ttft_slo_s, tightened by deadline_s - now (the adapter's clock, UNIX
    time; rank 0's on a synced server). A passed deadline is a target no
    request meets: with slo_guard the core refuses it as slo_infeasible."""
    return request_fields.ttft_target(fields, config.default_ttft_slo_s, now)
