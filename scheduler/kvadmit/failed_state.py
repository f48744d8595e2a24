"""kvadmit's failed state as an HTTP server shows it, in both engines: the state names,
the `x-kvadmit-state` header on `/health` (and the load routes), and the 503 answer of
`/health` once kvadmit failed closed (docs/trust-and-failure.md, "kvadmit's failed
states"). vLLM's patch (patches/vllm_get_load.py) and SGLang's middleware
(kvadmit.sglang.health) answer with these; each reads the state its own way.
"""
from __future__ import annotations

import json

OK, FAILED_OPEN, FAILED_CLOSED = "ok", "failed-open", "failed-closed"
STATE_HEADER = b"x-kvadmit-state"
FAILED_CLOSED_MESSAGE = ("kvadmit failed inside the engine and, configured with "
                         "on_internal_error: closed, refuses every request until the server "
                         "is restarted")


def state_headers(headers, state: str, length: int | None = None) -> list:
    """`headers` (ASGI pairs) with kvadmit's state header (one, replacing any), and a
    new content-length where `length` is given."""
    out = [(k, v) for k, v in headers if k.lower() != STATE_HEADER
           and (length is None or k.lower() != b"content-length")]
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out + [(STATE_HEADER, state.encode())]


def with_state_header(send, state: str):
    """An ASGI send that adds kvadmit's state header to the response."""
    async def send_with_state(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": state_headers(message.get("headers", []), state)}
        await send(message)
    return send_with_state


async def answer_failed_closed(send) -> None:
    """`/health` once kvadmit failed closed: 503, so a router or orchestrator takes the
    server out."""
    body = json.dumps({"kvadmit": FAILED_CLOSED, "message": FAILED_CLOSED_MESSAGE}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (STATE_HEADER, FAILED_CLOSED.encode())]})
    await send({"type": "http.response.body", "body": body})
