"""vLLM 0.32: a kvadmit rejection becomes an HTTP error before the response starts.

The engine's scheduler (kvadmit.vllm) refuses a request by finishing it with
finish_reason "abort" and stop_reason "kvadmit:<reason>". Through `vllm serve`
that would be a 200 response with finish_reason "abort". This patch wraps
`AsyncLLM.generate` so that such an output raises a `GracefulHTTPError` instead,
which vLLM's OpenAI server turns into an error response: 503 Service
Unavailable for overload (queue_full, queued_tokens_full, queue_delay, shed,
slo_infeasible), 400 Bad Request for a request this server can never run
(context_length, kv_capacity, invalid). Non-streaming responses get the status
code; a streaming response has already started, so its client gets vLLM's error
event in the stream instead. An `invalid` refusal caused by a malformed kvadmit
request field (vllm_xargs kvadmit_*) gets a message naming the field.

Applied in every vLLM process by the `vllm.general_plugins` entry point
`kvadmit` (kvadmit.vllm.plugin); outputs without a kvadmit stop_reason pass
through untouched, so it changes nothing unless kvadmit refused the request.
"""
from __future__ import annotations

import math
from http import HTTPStatus

from kvadmit_patches import wrap

TARGET = "vllm.v1.engine.async_llm.AsyncLLM.generate"
VERSIONS = ("0.32.0",)
PREFIX = "kvadmit:"
OVERLOAD = ("queue_full", "queued_tokens_full", "queue_delay", "shed", "slo_infeasible")
MESSAGES = {
    "queue_full": "the engine's waiting queue is full (kvadmit max_queued_requests); retry later",
    "queued_tokens_full": "the engine's prefill backlog is full (kvadmit max_queued_tokens); retry later",
    "queue_delay": "the predicted wait in the engine's queue exceeds kvadmit max_queue_delay_s; retry later",
    "shed": "the request was shed for a higher-priority request; retry later",
    "slo_infeasible": "the predicted time to first token exceeds the request's TTFT target "
                      "(ttft_slo_s / deadline_s, or the server's default); retry later or relax it",
    "context_length": "prompt tokens + max_tokens exceed the model's context length",
    "kv_capacity": "the request needs more KV cache than this server's whole pool holds",
    "invalid": "the request's token counts or kvadmit fields are invalid",
}


def rejection_reason(output) -> str | None:
    """The kvadmit reason code if this RequestOutput is a kvadmit rejection."""
    if not getattr(output, "finished", False) or not output.outputs:
        return None
    stop = output.outputs[0].stop_reason
    if output.outputs[0].finish_reason == "abort" and isinstance(stop, str) and stop.startswith(PREFIX):
        return stop[len(PREFIX):]
    return None


# kvadmit.vllm.scheduler puts these in a refused output's kv_transfer_params.
RETRY_AFTER_KEY = "kvadmit_retry_after_s"
DETAIL_KEY = "kvadmit_detail"


def refusal_detail(output) -> str | None:
    """What the engine found wrong with a request it refused as `invalid` (the
    message names the kvadmit field), if it said."""
    params = getattr(output, "kv_transfer_params", None)
    return params.get(DETAIL_KEY) if isinstance(params, dict) else None


def retry_after_s(output) -> int | None:
    """The engine's Retry-After hint for a refused output, whole seconds (at least 1)."""
    params = getattr(output, "kv_transfer_params", None)
    if not isinstance(params, dict) or params.get(RETRY_AFTER_KEY) is None:
        return None
    return max(1, math.ceil(float(params[RETRY_AFTER_KEY])))


def error_for(reason: str, detail: str | None = None, retry_after: int | None = None):
    from vllm.exceptions import GracefulHTTPError

    status = HTTPStatus.SERVICE_UNAVAILABLE if reason in OVERLOAD else HTTPStatus.BAD_REQUEST
    message = detail or MESSAGES.get(reason, "refused by kvadmit")
    if retry_after is not None and status == HTTPStatus.SERVICE_UNAVAILABLE:
        # patches/vllm_retry_after.py turns this into the Retry-After header.
        message += f" (retry after {retry_after} s)"
    return GracefulHTTPError(f"{PREFIX}{reason}: {message}", status)


def apply() -> bool:
    """Installs the wrapper once; returns False (and does nothing) on other versions."""
    import vllm
    from vllm.v1.engine.async_llm import AsyncLLM

    if vllm.__version__ not in VERSIONS:
        return False

    def make(original):
        async def generate(self, *args, **kwargs):
            async for output in original(self, *args, **kwargs):
                reason = rejection_reason(output)
                if reason is not None:
                    raise error_for(reason, refusal_detail(output), retry_after_s(output))
                yield output
        return generate

    wrap(AsyncLLM, "generate", make)
    return True
