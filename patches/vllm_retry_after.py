"""vLLM 0.32, 0.33 and 0.34: a `Retry-After` header on kvadmit's 429 (or 503) answers.

vLLM's error responses carry no headers (GracefulHTTPError has a message and a
status only). kvadmit's HTTP patch (vllm_http_status.py) writes the engine's
hint into the message as "(retry after N s)" (kvadmit.protocol); this patch adds an ASGI middleware,
installed with vLLM's own ones when the API server app is built, that copies N
into a `Retry-After: N` header on 503 and 429 responses whose body is a kvadmit
refusal (429 where the config's `overload_status` says so), and N as the number
`retry_after_s` into the body's "error" object beside the message (a router that
drops the header, vllm-router on a 503 it gives up on among them, still forwards the
body; the message is unchanged). Every other response passes through untouched (the
body is not buffered beyond the first chunk of a 503 or 429; a body in several
chunks keeps its bytes and gets the header only).

Applied in every vLLM process by the `vllm.general_plugins` entry point; the API
server loads it before it builds its app (the engine client comes first).
"""
from __future__ import annotations

from kvadmit.protocol import OVERLOAD_STATUSES, RETRY_HINT_RE, body_with_retry_after
from kvadmit_patches import MIDDLEWARE_HOOK, add_app_middleware, require

TARGET = "vllm.entrypoints.launchers.app.init_entrypoints_middleware"
# The same hook on each: init_entrypoints_middleware (entrypoints/serve/middleware/
# register.py) and the app builder that calls it are unchanged since 0.32.0.
SERIES = ("0.32", "0.33", "0.34")
TARGETS = (MIDDLEWARE_HOOK,)
HINT = RETRY_HINT_RE
STATUSES = frozenset(int(s) for s in OVERLOAD_STATUSES)


class RetryAfterMiddleware:
    """Adds `Retry-After` (and `retry_after_s` in the body) to 503 and 429 responses
    that carry a kvadmit retry hint."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held = None

        async def send_with_header(message):
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] in STATUSES:
                held = message                      # wait for the body to read the hint
                return
            if held is not None and message["type"] == "http.response.body":
                start, held = held, None
                match = HINT.search(message.get("body", b""))
                if match:
                    headers = list(start.get("headers", []))
                    body = (None if message.get("more_body") else
                            body_with_retry_after(message.get("body", b""), int(match.group(1))))
                    if body is not None:      # the whole body in one message: the hint in it too
                        message = {**message, "body": body}
                        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                        headers.append((b"content-length", str(len(body)).encode()))
                    start = {**start, "headers": headers + [(b"retry-after", match.group(1))]}
                await send(start)
            await send(message)

        await self.app(scope, receive, send_with_header)


def apply() -> bool:
    """Installs the middleware hook once; PatchUnavailable (nothing done) where it
    cannot apply."""
    require(__name__)
    add_app_middleware(RetryAfterMiddleware)
    return True
