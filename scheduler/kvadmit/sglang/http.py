"""SGLang's OpenAI server: a kvadmit refusal is an HTTP error with Retry-After, streaming or not.

SGLang answers a request its scheduler aborted with a status (kvadmit's refusals
carry one, `kvadmit.sglang.request.rejection_finish_reason`): without streaming an
error response with that status but no Retry-After header; with streaming a 200
stream whose first event is the error (SGLang primes a stream's first chunk, but
only a ValueError raised there becomes a status). This hook, AROUND
`OpenAIServingBase.handle_request` (every OpenAI route: completions and chat),
makes both the same answer: a kvadmit refusal in a stream's first event becomes
the error response the non-streaming path gives (same status, type and message),
and every kvadmit error response with a retry hint gets `Retry-After` (and the
same number as `retry_after_s` beside the message in its body). Everything
else passes through, the first event of an admitted stream is put back in front.

It runs in SGLang's HTTP server process, installed with the command-line hooks in
every process where SGLang's OpenAI server imports (it acts only on kvadmit's
messages); where it does not (a process without the server's dependencies,
torchvision among them), no OpenAI server can run either, and the hook is left out.
"""
from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Optional

from kvadmit.protocol import OVERLOAD_STATUSES, PREFIX, RETRY_HINT_RE, body_with_retry_after

SERVING_MODULE = "sglang.srt.entrypoints.openai.serving_base"
T_HANDLE_REQUEST = SERVING_MODULE + ".OpenAIServingBase.handle_request"
_RETRYABLE = frozenset(int(s) for s in OVERLOAD_STATUSES)
_EVENT = re.compile(rb"^data: (.*?)\s*$", re.S)


def refusal_in_event(chunk) -> Optional[tuple[int, str]]:
    """(status, message) when a stream's event is a kvadmit refusal, else None."""
    raw = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
    match = _EVENT.match(raw)
    if match is None:
        return None
    try:
        error = json.loads(match.group(1)).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict) or not str(error.get("message", "")).startswith(PREFIX):
        return None
    return int(error.get("code") or HTTPStatus.BAD_REQUEST), str(error["message"])


def error_response(serving, status: int, message: str):
    """The response SGLang's non-streaming path gives a refusal of this status
    (HTTPException -> its status as the type; a 400 is its ValueError path)."""
    if status == HTTPStatus.BAD_REQUEST:
        return serving.create_error_response(message=message, err_type="BadRequest",
                                             status_code=400)
    return serving.create_error_response(message=message, err_type=str(status),
                                         status_code=status)


def with_retry_after(response):
    """Adds Retry-After to a kvadmit refusal with a hint (429 or 503), and the hint
    as the number `retry_after_s` beside the message in its JSON body."""
    if getattr(response, "status_code", None) in _RETRYABLE:
        match = RETRY_HINT_RE.search(getattr(response, "body", b"") or b"")
        if match and "retry-after" not in response.headers:
            response.headers["retry-after"] = match.group(1).decode()
        body = match and body_with_retry_after(response.body, int(match.group(1)))
        if body:
            response.body = body
            response.headers["content-length"] = str(len(body))
    return response


async def _chain(first, rest):
    yield first
    async for chunk in rest:
        yield chunk


async def around_handle_request(original, self, *args, **kwargs):
    response = await original(self, *args, **kwargs)
    stream = getattr(response, "body_iterator", None)
    if stream is None:
        return with_retry_after(response)
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return response
    refusal = refusal_in_event(first)
    if refusal is None:
        response.body_iterator = _chain(first, stream)
        return response
    await stream.aclose()
    refused = with_retry_after(error_response(self, *refusal))
    refused.background = response.background      # SGLang's abort task for the request
    return refused
