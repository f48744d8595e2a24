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
`invalid` naming the field.

It is also where the API server decides who may raise a request's claim
(kvadmit.trust, docs/trust-and-failure.md): where the config's `untrusted_fields`
resolves to ignore or refuse, every POST whose JSON body names a field that would raise
its claim (a `kvadmit_*` key of `vllm_xargs`, headers included, or a negative
`priority`) is screened: from a trusted source (the gateway secret's header, or a
connection whose own socket peer is in `trusted_proxies`: kvadmit_patches.asgi_socket_peer,
never the address uvicorn took from X-Forwarded-For) it passes, with the gateway's
headers winning over the body; from any other client each raise is removed (the
server's default applies) and counted in `kvadmit_untrusted_fields_total{field}`, or
the request is refused with 400 naming them. A request with one of a flow's API keys
(`flows[...].api_keys`, vLLM's own --api-key values) is that flow's and at most its
min_priority, whatever it claims. The secret's header never reaches vLLM (any method).
Other requests pass through untouched.
"""
from __future__ import annotations

import json
import time

from kvadmit.protocol import Refusal
from kvadmit.request_fields import FLAT_PREFIX, HEADERS, KEY
from kvadmit.trust import (PRIORITY, PROXY, SECRET, SECRET_HEADER, UNTRUSTED_KEY, count,
                           refusal_message, require_socket_peer, same_flow, socket_peer)
from kvadmit_patches import MIDDLEWARE_HOOK, add_app_middleware, asgi_socket_peer, require

TARGET = "vllm.entrypoints.launchers.app.init_entrypoints_middleware"
SERIES = ("0.32", "0.33", "0.34")     # the same hook as vllm_retry_after.py
TARGETS = (MIDDLEWARE_HOOK, asgi_socket_peer.TARGET)
# Which header carries which field, and in what unit: kvadmit.request_fields.SCHEMA.
# A duration's unit suffix -> seconds (as Go's time.ParseDuration writes the common ones).
UNITS = (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0))
PATHS = ("/v1/completions", "/v1/chat/completions")
FLOW = FLAT_PREFIX + "flow"
VLLM_SESSION_HEADER = b"x-session-id"       # vLLM's own (SESSION_ID_HEADER)


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
    None if the body is not a JSON object or its vllm_xargs not an object."""
    doc = _json_object(body)
    if doc is None or isinstance(_field_sets(doc), str):
        return None
    _merge(doc, fields, headers_win=False)
    return json.dumps(doc).encode()


def _json_object(body: bytes) -> dict | None:
    try:
        doc = json.loads(body or b"{}")
    except (ValueError, RecursionError):     # RecursionError: nested past the parser's depth
        return None
    return doc if isinstance(doc, dict) else None


def _unservable(doc: dict) -> tuple[str, str] | None:
    """(field, why) of the first thing in the body that vLLM 0.32 answers with a 500
    instead of a 400: a string UTF-8 cannot encode (a lone surrogate, as JSON's \\ud800
    gives) in a vllm_xargs key or value, which fails encoding for the engine core; a
    token id of the prompt beyond 64 bits, which fails before any check of vLLM's or
    kvadmit's."""
    def bad_text(value) -> bool:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
            return False
        if isinstance(value, dict):
            return any(bad_text(k) or bad_text(v) for k, v in value.items())
        return isinstance(value, list) and any(bad_text(v) for v in value)
    xargs = doc.get("vllm_xargs")
    for key, value in (xargs.items() if isinstance(xargs, dict) else ()):
        if bad_text(key) or bad_text(value):
            name = key.encode("utf-8", "backslashreplace").decode()
            return f"vllm_xargs.{name}", "is not valid Unicode (a lone surrogate): no UTF-8 for it"
    prompt = doc.get("prompt")
    for ids in (prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list)
                else [prompt] if isinstance(prompt, list) else []):
        for token in (ids if isinstance(ids, list) else []):
            if isinstance(token, int) and not -2**63 <= token < 2**63:
                return "prompt", f"has token id {token}, beyond 64 bits"
    return None


def _merge(doc: dict, fields: dict, headers_win: bool) -> None:
    """Puts the header fields into the body's vllm_xargs (an object, or none: `_field_sets`)."""
    if fields:
        xargs = doc.get("vllm_xargs") or {}
        doc["vllm_xargs"] = {**xargs, **fields} if headers_win else {**fields, **xargs}


def _field_sets(doc: dict) -> list[dict] | str:
    """The body's objects of flat kvadmit_* fields: vllm_xargs (the OpenAI routes) and
    sampling_params.extra_args (vLLM's token-in /inference/v1/generate); or the name of
    one that is given but not an object (vLLM would refuse it, or a route that does not
    read it ignore it: either way nothing in it can be screened)."""
    out = []
    sampling = doc.get("sampling_params")
    for name, holder, key in (("vllm_xargs", doc, "vllm_xargs"),
                              ("sampling_params.extra_args",
                               sampling if isinstance(sampling, dict) else {}, "extra_args")):
        value = holder.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            return name
        out.append(value)
    return out


def screen(doc: dict, trust, now_unix: float, headers=(), keyed=False) -> list[str]:
    """An untrusted request's raises (kvadmit.trust), by the names the client used
    (kvadmit_<field> in vllm_xargs or extra_args, priority): their values removed from
    `doc` (the server's defaults apply). A `keyed` request's flow and priority are its
    API key's (`bind`), not screened here. A value that does not parse is left for
    kvadmit to refuse as invalid."""
    keep = {"flow"} if keyed else set()
    names = []
    for xargs in _field_sets(doc):
        values = {k[len(FLAT_PREFIX):]: v for k, v in xargs.items() if k.startswith(FLAT_PREFIX)}
        for f in trust.raised(values, now_unix):
            if f not in keep:
                del xargs[FLAT_PREFIX + f]
                names.append(FLAT_PREFIX + f)
        nested = xargs.get(KEY)          # the object form, should a release let it through
        for f in trust.raised(nested if isinstance(nested, dict) else {}, now_unix):
            if f not in keep:
                del nested[f]
                names.append(f"{KEY}.{f}")
    if not keyed and _priority_below(doc, 0):
        doc.pop(PRIORITY)
        names.append(PRIORITY)
    # vLLM's own session id (body, X-Session-ID, vllm_xargs) stays vLLM's; marked, kvadmit
    # does not take it as the request's session (kvadmit.vllm.admission): counted,
    # never refused (it is vLLM's field).
    xargs = doc.get("vllm_xargs") or {}
    if doc.get("session_id") or xargs.get("session_id") or any(
            k.lower() == VLLM_SESSION_HEADER for k, _ in headers):
        doc["vllm_xargs"] = {**xargs, UNTRUSTED_KEY: True}
        count(["session_id"])
    return list(dict.fromkeys(names))


def bind(doc: dict, binding) -> list[str]:
    """A request authenticated by a flow's API key (kvadmit.trust.Trust.bound): that
    flow whatever it claimed, and no priority more important than the key's
    min_priority (set to it); the names of the claims overridden."""
    sets = _field_sets(doc)
    if not sets:
        doc["vllm_xargs"] = {}
        sets = _field_sets(doc)
    names = []
    for xargs in sets:
        if FLOW in xargs and not same_flow(xargs[FLOW], binding.flow):
            names.append(FLOW)
        nested = xargs.get(KEY)
        if isinstance(nested, dict) and "flow" in nested:
            if not same_flow(nested.pop("flow"), binding.flow):
                names.append(f"{KEY}.flow")
        xargs[FLOW] = binding.flow
    if _priority_below(doc, binding.min_priority):
        doc[PRIORITY] = binding.min_priority
        names.append(PRIORITY)
    return list(dict.fromkeys(names))


def _priority_below(doc: dict, floor: int) -> bool:
    """Whether the body's priority, read as vLLM's request models read it (an integer,
    a float without a fraction, or either as text), is below `floor`."""
    value = doc.get(PRIORITY)
    if isinstance(value, str):
        try:
            value = float(value.strip()) if "." in value or "e" in value.lower() else int(value)
        except ValueError:
            return False                 # vLLM refuses it
    if isinstance(value, float):
        value = int(value) if value.is_integer() else None
    return isinstance(value, int) and not isinstance(value, bool) and value < floor


FORM_CLAIMS = (b'name="vllm_xargs"', b'name="priority"', b"vllm_xargs=", b"priority=")
FORM_REFUSAL = Refusal("invalid", "vllm_xargs or priority in a form (vLLM's audio routes) cannot "
                       "be screened or bound to an API key: send them from a trusted gateway")


def _form_claim(body: bytes, headers) -> bool:
    """Whether a form body (vLLM's audio routes) carries vllm_xargs or a priority, which
    the middleware cannot screen or bind."""
    kind = next((v for k, v in headers if k.lower() == b"content-type"), b"").lower()
    return kind.startswith((b"multipart/form-data", b"application/x-www-form-urlencoded")) \
        and any(c in body for c in FORM_CLAIMS)


class SloHeaderMiddleware:
    """The gateway headers into vllm_xargs, and who may raise a claim (kvadmit.trust):
    with `trust` screening, the raises of a request without the gateway secret are
    removed (counted) or refused with 400: from a proxy in trusted_proxies (the
    socket's peer) those of its body, whose headers win; from any other client those of
    its headers and body. A request with a flow's API key is that flow's (`bind`). The
    gateway secret's header is removed from every HTTP and websocket request."""

    def __init__(self, app, trust=None):
        self.app = app
        self.trust = trust

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if any(k.lower() == SECRET_HEADER for k, _ in headers):
            scope = {**scope, "headers": [(k, v) for k, v in headers if k.lower() != SECRET_HEADER]}
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        fields = slo_fields(headers) if scope.get("path") in PATHS else {}
        screening = self.trust is not None and self.trust.screens
        binding = self.trust.bound(headers) if self.trust is not None else None
        if not fields and not screening and binding is None:
            return await self.app(scope, receive, send)
        body, early = await _read_body(receive)
        if early is not None:
            return await self.app(scope, _replay([early]), send)
        # None: screened as any client's (under honour, nothing is screened)
        source = self.trust.source(headers, socket_peer(scope)) if screening else None
        doc = _json_object(body)
        refusal = self._screen(doc, fields, screening, source, binding, headers) \
            if doc is not None else (
                ("vllm_xargs", FORM_REFUSAL.client_message())
                if ((screening and source != SECRET) or binding) and _form_claim(body, headers)
                else None)
        if refusal is not None:
            return await _refuse(send, *refusal)
        if doc is not None:
            body = json.dumps(doc).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = {**scope, "headers": headers}
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}],
                                      receive), send)

    def _screen(self, doc: dict, fields: dict, screening: bool, source, binding, headers):
        """Screens and binds `doc` in place; (field, message) of a 400, or None."""
        sets = _field_sets(doc)
        if isinstance(sets, str):
            if (not screening or source == SECRET) and binding is None:
                return None                 # nothing to screen: vLLM judges it
            return sets, f"{sets} must be an object"
        keyed, now = binding is not None, time.time()
        # a proxy vouches for the headers it sets, not for the body it forwards
        raised = screen(doc, self.trust, now, (), keyed) if screening and source == PROXY else []
        _merge(doc, fields, headers_win=screening and source is not None)
        if screening and source is None:
            raised += screen(doc, self.trust, now, headers, keyed)
        if binding is not None:
            raised += bind(doc, binding)
        raised = list(dict.fromkeys(raised))
        count(raised)
        if raised and self.trust.mode == "refuse":
            return raised[0], refusal_message(raised)
        unservable = _unservable(doc)
        if unservable is not None:
            field, why = unservable
            return field, Refusal("invalid", f"{field} {why}").client_message()
        return None


async def _read_body(receive) -> tuple[bytes, dict | None]:
    """The whole request body, or a non-body message that came first."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return b"", message
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks), None


async def _refuse(send, param: str, message: str) -> None:
    """400 in vLLM's error shape, naming the field `param`."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError",
                                 "param": param, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def trust_of(args):
    """The trust rule of a vLLM API server's arguments: None unless kvadmit is its
    scheduler (kvadmit's settings are then checked where vLLM builds its config).
    ConfigError where it cannot be kept: trusted_proxies without the socket's peer
    address (kvadmit_patches.asgi_socket_peer), or API keys the server does not check."""
    from vllm import envs

    from kvadmit.trust import Trust
    from kvadmit.vllm.plugin import _names_kvadmit
    from kvadmit.vllm.settings import configs_of

    if not _names_kvadmit(getattr(args, "scheduler_cls", None)):
        return None
    config, _ = configs_of(getattr(args, "additional_config", None))
    trust = Trust.of(config)
    require_socket_peer(trust, asgi_socket_peer.installed())
    trust.check_server_keys(getattr(args, "api_key", None) or [envs.VLLM_API_KEY])
    return trust


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
    asgi_socket_peer.apply()
    add_app_middleware(SloHeaderMiddleware, lambda args: {"trust": trust_of(args)})
    return True
