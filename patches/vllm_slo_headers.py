"""vLLM 0.32, 0.33 and 0.34: the Gateway API Inference Extension's SLO and fairness request
headers, and llm-d's TTL header, as kvadmit's per-request fields.

GIE (and llm-d) carry a request's targets in `x-slo-ttft-ms` and `x-slo-tpot-ms`, and
llm-d its time to live in `x-llm-d-inference-ttl` (seconds, or a duration such as
`30s`, `1500ms`, `2m`): kvadmit's `ttl_s`, past which a request that has not
started is dropped unserved (`expired`). GIE's flow control groups requests into
flows by `x-gateway-inference-fairness-id`: kvadmit's `flow` (the id as it is: digits
are that integer, any other text a stable hash), whose fair share of the KV pool
docs/flows.md describes. GIE's sheddable class (an objective of negative priority)
does not reach the engine, so a gateway route marks it with `x-kvadmit-sheddable:
true`: kvadmit's `sheddable` (docs/capacity.md), and a client's own cap on its queueing
delay `x-kvadmit-max-queue-delay` (a duration): kvadmit's `max_queue_delay_s`. Which
header carries which field, in what unit, is declared in kvadmit.request_fields.SCHEMA.
vLLM passes no header to the engine, so this ASGI middleware (installed when the
API server app is built, as the Retry-After one, vllm_retry_after.py) writes them into the JSON body
of completion and chat-completion requests as the flat `vllm_xargs` keys kvadmit
reads (`kvadmit_ttft_slo_s`, `kvadmit_tpot_slo_s`, `kvadmit_ttl_s` in seconds,
`kvadmit_flow`, `kvadmit_sheddable`, `kvadmit_max_queue_delay_s`). A field the body already
sets wins; a malformed header is passed on as it is, so kvadmit refuses it as
`invalid` naming the field. Other requests pass through untouched.
"""
from __future__ import annotations

import json

from kvadmit.request_fields import FLAT_PREFIX, HEADERS
from kvadmit_patches import MIDDLEWARE_HOOK, add_app_middleware, require

TARGET = "vllm.entrypoints.launchers.app.init_entrypoints_middleware"
SERIES = ("0.32", "0.33", "0.34")     # the same hook as vllm_retry_after.py
TARGETS = (MIDDLEWARE_HOOK,)
# Which header carries which field, and in what unit: kvadmit.request_fields.SCHEMA.
# A duration's unit suffix -> seconds (as Go's time.ParseDuration writes the common ones).
UNITS = (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0))
PATHS = ("/v1/completions", "/v1/chat/completions")


def slo_fields(headers) -> dict:
    """The flat kvadmit fields the headers ask for: times in seconds, the flow and
    sheddable as text."""
    out = {}
    for name, value in headers:
        field = HEADERS.get(name.lower())
        if field is None:
            continue
        key, text = FLAT_PREFIX + field.name, value.decode("latin-1").strip()
        if field.header_unit == "text":
            out[key] = text     # "" too: kvadmit's field check names it
            continue
        try:
            out[key] = float(text) / 1000.0 if field.header_unit == "ms" else duration_s(text)
        except ValueError:
            out[key] = text     # kvadmit's field check names it
    return out


def duration_s(text: str) -> float:
    """Seconds of "30", "30s", "1500ms", "2m" or "1h" (ValueError otherwise)."""
    for suffix, scale in UNITS:
        if text.endswith(suffix) and not (suffix == "s" and text.endswith("ms")):
            return float(text[:-len(suffix)]) * scale
    return float(text)


def with_fields(body: bytes, fields: dict) -> bytes | None:
    """The JSON body with `fields` added to its vllm_xargs (the body's own win);
    None if the body is not a JSON object."""
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    xargs = doc.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        return None
    doc["vllm_xargs"] = {**fields, **xargs}
    return json.dumps(doc).encode()


class SloHeaderMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            return await self.app(scope, receive, send)
        fields = slo_fields(scope.get("headers", []))
        if not fields:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        new = with_fields(body, fields)
        if new is None:
            new = body
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        scope = {**scope, "headers": headers}
        await self.app(scope, _replay([{"type": "http.request", "body": new, "more_body": False}],
                                      receive), send)


def _replay(messages, then=None):
    """An ASGI receive that hands out `messages`, then defers to `then`."""
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        return await then()
    return receive


def apply() -> bool:
    """Installs the middleware hook once; PatchUnavailable (nothing done) where it
    cannot apply."""
    require(__name__)
    add_app_middleware(SloHeaderMiddleware)
    return True
