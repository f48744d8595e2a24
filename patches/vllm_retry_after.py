"""vLLM 0.32, 0.33 and 0.34: a `Retry-After` header on kvadmit's 503 (or 429) answers.

vLLM's error responses carry no headers (GracefulHTTPError has a message and a
status only). kvadmit's HTTP patch (vllm_http_status.py) writes the engine's
hint into the message as "(retry after N s)" (kvadmit.protocol); this patch adds an ASGI middleware,
installed with vLLM's own ones when the API server app is built, that copies N
into a `Retry-After: N` header on 503 and 429 responses whose body is a kvadmit
refusal (429 where the config's `overload_status` says so). Every other response
passes through untouched (the body is not buffered beyond the first chunk of a
503 or 429).

Applied in every vLLM process by the `vllm.general_plugins` entry point; the API
server loads it before it builds its app (the engine client comes first).
"""
from __future__ import annotations

from kvadmit.protocol import OVERLOAD_STATUSES, RETRY_HINT_RE
from kvadmit_patches import MIDDLEWARE_HOOK, add_app_middleware, require

TARGET = "vllm.entrypoints.launchers.app.init_entrypoints_middleware"
# The same hook on each: init_entrypoints_middleware (entrypoints/serve/middleware/
# register.py) and the app builder that calls it are unchanged since 0.32.0.
SERIES = ("0.32", "0.33", "0.34")
TARGETS = (MIDDLEWARE_HOOK,)
HINT = RETRY_HINT_RE
STATUSES = frozenset(int(s) for s in OVERLOAD_STATUSES)


class RetryAfterMiddleware:
    """Adds `Retry-After` to 503 and 429 responses that carry a kvadmit retry hint."""

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
                    start = {**start, "headers": list(start.get("headers", []))
                             + [(b"retry-after", match.group(1))]}
                await send(start)
            await send(message)

        await self.app(scope, receive, send_with_header)


def apply() -> bool:
    """Installs the middleware hook once; PatchUnavailable (nothing done) where it
    cannot apply."""
    require(__name__)
    add_app_middleware(RetryAfterMiddleware)
    return True
