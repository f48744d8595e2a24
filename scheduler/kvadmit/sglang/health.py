"""SGLang's HTTP server showing kvadmit's failed states, as vLLM's does
(patches/vllm_get_load.py; docs/trust-and-failure.md, "kvadmit's failed states").

- ``GET /health`` and ``GET /health_generate`` (one SGLang handler; SMG and sglang-router
  probe ``/health``): SGLang's own answer with the header ``x-kvadmit-state: ok`` or
  ``failed-open``; once kvadmit failed closed (it refuses every new request until a
  restart) **503** ``{"kvadmit": "failed-closed", "message": ...}`` with
  ``x-kvadmit-state: failed-closed``, so a health-checking router or a readiness probe
  takes the server out.
- ``GET /v1/loads`` (SMG's load probe): SGLang's answer with ``"kvadmit": {"state": ...}``
  beside its ``loads``; failed closed, every rank's ``token_usage`` is 1.0 (SMG reads
  it as KV usage: over any overload threshold). Its ``format=prometheus`` text is
  SGLang's, with the header only.

The state is `kvadmit.sglang.failure.server_state` (the schedulers' state files). The
middleware wraps the stack SGLang's app builds at its first request (an AFTER hook on
FastAPI's ``build_middleware_stack``, acting only for SGLang's app in
``sglang.srt.entrypoints.http_server``): it is in place however the server was launched
(``sglang serve``, ``python -m sglang.launch_server``, or ``launch_server`` called from
code, which imports the HTTP server before SGLang loads its plug-ins), and outermost, so
SGLang's API-key check still guards ``/v1/loads`` (SGLang lets ``/health`` through
without a key). Without kvadmit (no KVADMIT_CONFIG) every answer is SGLang's alone.

Imports no SGLang.
"""
from __future__ import annotations

import json
import sys

from kvadmit.failed_state import (FAILED_CLOSED, answer_failed_closed, state_headers,
                                  with_state_header)
from kvadmit.sglang.failure import server_state

T_BUILD_STACK = "fastapi.applications.FastAPI.build_middleware_stack"
HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"
HEALTH_PATHS = frozenset({"/health", "/health_generate"})
LOADS_PATH = "/v1/loads"
WATCHED = HEALTH_PATHS | {LOADS_PATH}


def after_build_middleware_stack(result, app, *args, **kwargs):
    """AFTER FastAPI.build_middleware_stack: SGLang's app gets `FailedStateMiddleware`
    around its whole stack; any other app is left as it is."""
    server = sys.modules.get(HTTP_SERVER_MODULE)
    if server is None or getattr(server, "app", None) is not app:
        return result
    return FailedStateMiddleware(result)


def route_path(scope) -> str:
    """The request's path inside the app (without a --fastapi-root-path prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def loads_with_state(body: bytes, state: str):
    """SGLang's /v1/loads JSON answer with kvadmit's state (see the module docstring);
    None when ``body`` is not that answer."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if not isinstance(answer, dict) or not isinstance(answer.get("loads"), list):
        return None
    answer["kvadmit"] = {"state": state}
    if state == FAILED_CLOSED:
        for load in answer["loads"]:
            if isinstance(load, dict):
                load["token_usage"] = 1.0
    return json.dumps(answer).encode()


def with_loads_state(send, state: str):
    """A send that holds SGLang's /v1/loads answer until its last byte, then sends it
    with kvadmit's state (`loads_with_state`), or unchanged with the header."""
    start, chunks = {}, []

    async def send_loads(message):
        if message["type"] == "http.response.start":
            start.update(message)
            return
        if message["type"] != "http.response.body" or not start:
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        new = loads_with_state(body, state) if start["status"] == 200 else None
        await send({**start, "headers": state_headers(start.get("headers", []), state,
                                                      None if new is None else len(new))})
        await send({"type": "http.response.body", "body": body if new is None else new})
    return send_loads


class FailedStateMiddleware:
    """ASGI: kvadmit's state on SGLang's health and load routes (module docstring);
    every other request goes to SGLang's stack untouched."""

    def __init__(self, app, state=server_state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        path = route_path(scope) if scope["type"] == "http" else None
        if path not in WATCHED or scope.get("method") != "GET":
            return await self.app(scope, receive, send)
        state = self.state()
        if state is None:
            return await self.app(scope, receive, send)
        if state == FAILED_CLOSED and path in HEALTH_PATHS:
            return await answer_failed_closed(send)
        if path == LOADS_PATH:
            return await self.app(scope, receive, with_loads_state(send, state))
        return await self.app(scope, receive, with_state_header(send, state))
