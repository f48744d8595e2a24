"""SGLang: who may raise a request's claim (kvadmit.trust, docs/trust-and-failure.md).

Every HTTP route of SGLang's server (the OpenAI ones and the native `/generate`)
hands its request to `TokenizerManager.generate_request(obj, request)` with the
HTTP request beside it; offline (`sglang.Engine`) there is none, and everything is
trusted. A hook BEFORE that method screens a request that is not from a trusted
source: each field of `custom_params["kvadmit"]` (in every sample's sampling
parameters) that would raise its claim, and a `priority` (a request without one has
SGLang's least), is removed and counted (`kvadmit:untrusted_fields_total{field}`),
or, with `untrusted_fields: refuse`, the request is refused with a ValueError, which
SGLang answers with 400. The gateway secret's header is removed from the request.

Imports no SGLang: it reads the request object's attributes.
"""
from __future__ import annotations

import time
from typing import Optional

from kvadmit.request_fields import KEY
from kvadmit.trust import PRIORITY, SECRET_HEADER, Trust, count, refusal_message

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


def screen(obj, trust: Trust, now_unix: float) -> list[str]:
    """An untrusted request's raises, by their names in the request: removed from
    `obj` (a GenerateReqInput or EmbeddingReqInput)."""
    names = []
    params = getattr(obj, "sampling_params", None)
    for sp in (params if isinstance(params, list) else [params]):
        custom = sp.get("custom_params") if isinstance(sp, dict) else None
        fields = custom.get(KEY) if isinstance(custom, dict) else None
        if not isinstance(fields, dict):
            continue
        for name in trust.raised(fields, now_unix):
            del fields[name]
            names.append(f"custom_params.{KEY}.{name}")
    if getattr(obj, PRIORITY, None) is not None:
        obj.priority = None
        names.append(PRIORITY)
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
    if not trust.screens:
        return None
    client = getattr(request, "client", None)
    if trust.trusted(headers, getattr(client, "host", None)):
        return None
    raised = screen(obj, trust, time.time())
    count(raised, METRIC)
    if raised and trust.mode == "refuse":
        raise ValueError(refusal_message(raised))
    return None
