"""SGLang: who may raise a request's claim (kvadmit.trust, docs/trust-and-failure.md).

Every HTTP route of SGLang's server (the OpenAI ones and the native `/generate`)
hands its request to `TokenizerManager.generate_request(obj, request)` with the
HTTP request beside it; offline (`sglang.Engine`) there is none, and everything is
trusted. A hook BEFORE that method screens a request that is not from a trusted
source: each field of `custom_params["kvadmit"]` (in every sample's sampling
parameters) that would raise its claim, and a `priority` (a request without one has
SGLang's least), is removed and counted (`kvadmit:untrusted_fields_total{field}`),
or, with `untrusted_fields: refuse`, the request is refused with a ValueError, which
SGLang answers with 400. The gateway secret's header is removed from the request. A
trusted proxy is the connection's own socket peer (kvadmit_patches.asgi_socket_peer,
applied in SGLang's HTTP process), never the address uvicorn took from
X-Forwarded-For; such a proxy vouches for the headers it sets, and SGLang reads kvadmit's
fields from the body alone, so only the secret makes a request trusted here. SGLang
checks one `--api-key`: a request that presents it, where a
flow lists it (`flows[...].api_keys`), is that flow's whatever it claims; its priority
is screened as any other request's.

Imports no SGLang: it reads the request object's attributes.
"""
from __future__ import annotations

import time
from typing import Optional

from kvadmit.request_fields import KEY
from kvadmit.config import ConfigError
from kvadmit.flow_settings import key_digest
from kvadmit.trust import (PRIORITY, SECRET, SECRET_HEADER, Trust, count, refusal_message,
                           require_socket_peer, same_flow, socket_peer)

T_GENERATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
METRIC = "kvadmit:untrusted_fields"      # SGLang's kvadmit series are "kvadmit:*"
_cache: dict = {}


def server_trust() -> Optional[Trust]:
    """The trust rule of this server's kvadmit config (KVADMIT_CONFIG); None without
    one (kvadmit is off)."""
    from kvadmit.sglang.settings import config_text_from_env, load_config

    text = config_text_from_env()
    if text is None:
        return None
    if text not in _cache:
        _cache.clear()
        _cache[text] = Trust.of(load_config(text))
    return _cache[text]


def check_server(server_args) -> None:
    """Stops SGLang's start-up (ConfigError) where this server's trust rule cannot be
    kept: trusted_proxies without the socket's own peer address (or served by Granian,
    --enable-http2), screening or API keys with HTTP workers that load no plug-in
    (--tokenizer-worker-num > 1), or a flow's API key that is not SGLang's --api-key."""
    from kvadmit_patches import PatchUnavailable, asgi_socket_peer

    trust = server_trust()
    if trust is None:
        return
    if trust.proxies and getattr(server_args, "enable_http2", False):
        raise ConfigError("kvadmit config: trusted_proxies needs the connection's own peer "
                          "address, which kvadmit reads from uvicorn; --enable-http2 serves "
                          "with Granian: drop one, or use the gateway secret")
    if (trust.screens or trust.keys) and (getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        raise ConfigError("kvadmit config: with --tokenizer-worker-num > 1 SGLang's HTTP "
                          "workers load no plug-in, so nothing would screen clients' kvadmit "
                          "fields or bind API keys: use one tokenizer worker, or "
                          "\"untrusted_fields\": \"honour\" with no api_keys")
    try:
        asgi_socket_peer.apply()
    except PatchUnavailable:
        pass                    # named by require_socket_peer where it matters
    require_socket_peer(trust, asgi_socket_peer.installed())
    trust.check_server_keys([getattr(server_args, "api_key", None)])


def screen(obj, trust: Trust, now_unix: float, keyed: bool = False) -> list[str]:
    """An untrusted request's raises, by their names in the request: removed from
    `obj` (a GenerateReqInput or EmbeddingReqInput). A `keyed` request's flow is its
    API key's (`bind`), not screened here."""
    names = []
    params = getattr(obj, "sampling_params", None)
    for sp in (params if isinstance(params, list) else [params]):
        custom = sp.get("custom_params") if isinstance(sp, dict) else None
        fields = custom.get(KEY) if isinstance(custom, dict) else None
        if not isinstance(fields, dict):
            continue
        for name in trust.raised(fields, now_unix):
            if keyed and name == "flow":
                continue
            del fields[name]
            names.append(f"custom_params.{KEY}.{name}")
    if getattr(obj, PRIORITY, None) is not None:
        obj.priority = None
        names.append(PRIORITY)
    return list(dict.fromkeys(names))


def _bound_flow(trust: Trust, headers, manager) -> Optional[str]:
    """The flow bound to the request's API key, where it is the server's own (SGLang
    checks that one key before this hook; a key it does not check proves nothing)."""
    binding = trust.bound(headers)
    server_key = getattr(getattr(manager, "server_args", None), "api_key", None)
    if binding is None or not server_key or trust.keys.get(key_digest(server_key)) != binding:
        return None
    return binding.flow


def bind(obj, flow: str) -> list[str]:
    """Every sample's kvadmit flow set to its API key's `flow`; the names of the other
    flows it claimed."""
    if getattr(obj, "sampling_params", None) is None:
        obj.sampling_params = {}
    params = obj.sampling_params
    names = []
    for sp in (params if isinstance(params, list) else [params]):
        custom = sp.setdefault("custom_params", {}) if isinstance(sp, dict) else None
        fields = custom.setdefault(KEY, {}) if isinstance(custom, dict) else None
        if not isinstance(fields, dict):
            continue                # left for the engine to refuse as malformed
        if "flow" in fields and not same_flow(fields["flow"], flow):
            names.append(f"custom_params.{KEY}.flow")
        fields["flow"] = flow
    return list(dict.fromkeys(names))


def before_generate_request(manager, obj, request=None, *args, **kwargs):
    """SGLang's BEFORE hook on TokenizerManager.generate_request (see the module
    docstring); returns None (the arguments as they are, screened in place)."""
    trust = server_trust()
    if request is None or trust is None:
        return None
    scope = getattr(request, "scope", None)
    headers = list(scope.get("headers", [])) if isinstance(scope, dict) else []
    if any(k.lower() == SECRET_HEADER for k, _ in headers):
        scope["headers"] = [(k, v) for k, v in headers if k.lower() != SECRET_HEADER]
    flow = _bound_flow(trust, headers, manager)
    if not trust.screens and flow is None:
        return None
    # SGLang's fields come in the body alone, for which only the secret vouches: a
    # proxy in trusted_proxies vouches for the headers it sets, not the body it forwards
    raised = [] if not trust.screens or trust.source(headers, socket_peer(scope)) == SECRET \
        else screen(obj, trust, time.time(), keyed=flow is not None)
    if flow is not None:
        raised += bind(obj, flow)
    count(raised, METRIC)
    if raised and trust.mode == "refuse":
        raise ValueError(refusal_message(raised))
    return None
