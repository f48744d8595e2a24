"""One vLLM request in the core's terms: its arrival record (`arrival_record`), the
twin of `kvadmit.sglang.request.arrival_record`.

Per-request settings (`kvadmit.request_fields`) come from the request's
``SamplingParams.extra_args``; with the request's own numbers (prompt, output cap,
priority, vLLM's priority order) they make the core's arrival record.

Imports no vLLM: the functions read a ``Request``'s attributes
(`kvadmit.vllm.compat.REQUEST_ATTRS`).
"""
from __future__ import annotations

import time

from kvadmit.arrival import ArrivalRecord, prompt_hash
from kvadmit.config import AdmissionConfig
from kvadmit.request_fields import (check_int, check_prompt_tokens, from_extra_args,
                                    record_columns, session_int, ttft_target)
from kvadmit.trust import UNTRUSTED_KEY


def output_cap(request) -> int:
    """The output tokens the core counts for a request: its max_tokens, or 0 for a
    pooling request (embed, classify, score: ``pooling_params`` set), which ends at
    its prompt's last token and never decodes. vLLM gives a pooling request
    max_tokens 1, so counting that would refuse a prompt of max_model_len tokens
    (context_length) that vLLM itself serves."""
    return 0 if request.pooling_params is not None else request.max_tokens


def arrival_record(request, config: AdmissionConfig, vocab_size: int, ties) -> ArrivalRecord:
    """The core's arrival record of a vLLM request (FieldError names a malformed field
    or what would crash the engine). ``ties``: vLLM's priority order's ties
    (`kvadmit.vllm.admission.RequestIdTies`; None under FCFS), given this request."""
    check_body(request, vocab_size)
    sp = request.sampling_params
    # A deadline (UNIX time) is read once, here, as a delay from this arrival: the
    # core takes it as a TTFT target on the adapter's own clock.
    now_unix = time.time()
    extra = sp.extra_args if sp is not None else None
    fields = from_extra_args(extra, now_unix)
    columns = record_columns(fields, ttft_target(fields, config.default_ttft_slo_s, now_unix))
    # vLLM's session_id (X-Session-ID), unless the client is untrusted (kvadmit.trust)
    if columns["session"] < 0 and request.session_id and not (extra or {}).get(UNTRUSTED_KEY):
        columns["session"] = session_int(request.session_id, "session_id")
    arrival_time = arrival_tie = 0.0
    if ties is not None:   # vLLM's priority order: its arrival_time, then id
        arrival_time = request.arrival_time
        arrival_tie = ties.add((request.priority, request.arrival_time), request.request_id)
    return ArrivalRecord(prompt_tokens=request.num_prompt_tokens,
                         max_new_tokens=output_cap(request), priority=request.priority,
                         arrival_time=arrival_time, arrival_tie=arrival_tie,
                         prompt_hash=prompt_hash(request.prompt_token_ids), **columns)


def check_body(request, vocab_size: int) -> None:
    """Refuses (FieldError) what would crash the engine further on: a prompt token
    id outside the vocabulary (vLLM checks none with --skip-tokenizer-init), and a
    priority or max_tokens beyond the core's integers (offline `LLM` passes any)."""
    check_prompt_tokens(request.prompt_token_ids, vocab_size,
                        multimodal=bool(request.mm_features))
    check_int(request.priority, "priority")
    check_int(request.max_tokens, "max_tokens", 1)
