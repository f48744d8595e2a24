"""The Retry-After middleware of patches/vllm_retry_after.py, on a bare ASGI app
(no vLLM needed): the header, and the hint as a number in the body, appear only on
kvadmit's 503 (or 429) refusals with a hint."""
import asyncio
import json

import pytest

from kvadmit_patches.vllm_retry_after import RetryAfterMiddleware


def call(status: int, message: str, chunks: int = 1):
    body = json.dumps({"error": {"message": message, "code": status}}).encode()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        step = -(-len(body) // chunks)
        for i in range(0, len(body), step):
            await send({"type": "http.response.body", "body": body[i:i + step],
                        "more_body": i + step < len(body)})

    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(RetryAfterMiddleware(app)({"type": "http"}, None, send))
    got = b"".join(m.get("body", b"") for m in sent[1:])
    headers = dict(sent[0]["headers"])
    if b"retry-after" in headers and chunks == 1:
        # the hint also as a number beside the message; nothing else in the body changed
        error = json.loads(got)["error"]
        assert error.pop("retry_after_s") == int(headers[b"retry-after"])
        assert error == {"message": message, "code": status}
        assert headers[b"content-length"] == str(len(got)).encode()
    else:
        assert got == body                                          # body untouched
    return headers, sent[0]["status"]


def test_kvadmit_503_with_a_hint_gets_the_header():
    headers, status = call(503, "kvadmit:queue_full: the engine's waiting queue is full "
                                "(kvadmit max_queued_requests); retry later (retry after 3 s)")
    assert status == 503 and headers[b"retry-after"] == b"3"


@pytest.mark.parametrize("status, message", [
    (503, "kvadmit:queue_full: the engine's waiting queue is full; retry later"),   # no hint
    (503, "The engine is currently busy (retry after 3 s)"),                       # not kvadmit's
    (400, "kvadmit:context_length: prompt tokens + max_tokens exceed the context"),
    (200, "fine"),
])
def test_other_responses_pass_through(status, message):
    headers, got = call(status, message)
    assert got == status and b"retry-after" not in headers


def test_a_streamed_body_is_forwarded_in_order():
    headers, _ = call(503, "kvadmit:slo_infeasible: too slow (retry after 12 s)", chunks=4)
    # the hint may straddle chunks: only the first chunk is read, the rest passes through
    assert headers.get(b"retry-after") in (None, b"12")


def test_kvadmit_429_with_a_hint_gets_the_header():
    """overload_status 429: the same header."""
    headers, status = call(429, "kvadmit:queue_delay: the predicted wait is 9 s "
                                "(retry after 4 s)")
    assert status == 429 and headers[b"retry-after"] == b"4"
