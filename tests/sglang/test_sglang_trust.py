"""SGLang: who may raise a request's claim (kvadmit.sglang.trust), on SGLang's real
GenerateReqInput, Starlette's Request and SGLang's own hook wrapper around the real
TokenizerManager.generate_request. SGLang cannot serve without CUDA: no HTTP server
runs here (its handlers answer a ValueError from generate_request with 400)."""
import asyncio
import json

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn  # noqa: E402
from starlette.requests import Request  # noqa: E402
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware  # noqa: E402

from kvadmit.config import ConfigError  # noqa: E402
from kvadmit.flow_settings import key_digest  # noqa: E402
from kvadmit_patches.asgi_socket_peer import SocketPeer  # noqa: E402

from kvadmit.sglang import plugin  # noqa: E402
from kvadmit.sglang.trust import (T_GENERATE, before_generate_request, check_server,  # noqa: E402
                                  server_trust)
from kvadmit.trust import PROXY, socket_peer  # noqa: E402
from kvadmit.trust import SECRET_ENV, SECRET_HEADER  # noqa: E402

GENERATE = _wrap_fn(TokenizerManager.generate_request, before_generate_request, HookType.BEFORE)
MANAGER = object.__new__(TokenizerManager)      # the hook runs before the method's body


def http_request(headers=(), peer="192.0.2.9"):
    """The request SGLang's route gets on a connection from `peer`, through what uvicorn
    puts in front of the app: kvadmit's socket-peer patch and uvicorn's own
    ProxyHeadersMiddleware (FORWARDED_ALLOW_IPS' default, 127.0.0.1)."""
    seen = {}

    async def app(scope, receive, send):
        seen["scope"] = scope
    server = SocketPeer(ProxyHeadersMiddleware(app, trusted_hosts="127.0.0.1"))
    asyncio.run(server({"type": "http", "method": "POST", "path": "/generate",
                        "headers": list(headers), "client": (peer, 5555)}, None, None))
    return Request(seen["scope"])


def generate(obj, request):
    """The wrapped method called as SGLang's routes call it (the async generator it
    returns is not run: the screening happened at the call)."""
    asyncio.run(GENERATE(MANAGER, obj, request).aclose())
    return obj


def request_obj(fields, priority=None, batch=False):
    sp = {"max_new_tokens": 8, "custom_params": {"kvadmit": dict(fields)}}
    return GenerateReqInput(input_ids=[[5, 6]] * 2 if batch else [5, 6],
                            sampling_params=[sp, json.loads(json.dumps(sp))] if batch else sp,
                            priority=priority)


@pytest.fixture
def config(monkeypatch):
    def set_config(values, secret=None):
        monkeypatch.setenv("KVADMIT_CONFIG", json.dumps(values))
        if secret is None:
            monkeypatch.delenv(SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
    return set_config


def untrusted_fields_total(field):
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("kvadmit:untrusted_fields_total", {"field": field}) or 0.0


def test_the_hook_is_on_the_http_servers_generate_request():
    assert plugin.http_hooks()[T_GENERATE] == (before_generate_request, HookType.BEFORE)


def test_an_untrusted_client_loses_its_raises_in_every_sample_and_keeps_the_rest(config):
    config({"flows": {"gold": {"weight": 4}}, "default_ttft_slo_s": 1.0})
    before = untrusted_fields_total("custom_params.kvadmit.flow")
    obj = generate(request_obj({"flow": "gold", "session": "a1", "ttft_slo_s": 5.0,
                                "sheddable": True}, priority=10, batch=True), http_request())
    for sp in obj.sampling_params:
        assert sp["custom_params"]["kvadmit"] == {"ttft_slo_s": 5.0, "sheddable": True}
    assert obj.priority is None
    assert untrusted_fields_total("custom_params.kvadmit.flow") == before + 1
    assert untrusted_fields_total("priority") >= 1


def test_a_gateway_with_the_secret_is_trusted_and_a_listed_proxy_vouches_for_no_body(config):
    config({"flows": {"gold": {}}, "trusted_proxies": ["10.0.0.0/8"]}, secret="s3cret")
    request = http_request([(b"X-KVAdmit-Gateway-Secret", b"s3cret")])
    obj = generate(request_obj({"flow": "gold"}, priority=10), request)
    assert obj.sampling_params["custom_params"]["kvadmit"] == {"flow": "gold"} and obj.priority == 10
    assert SECRET_HEADER not in dict(request.scope["headers"])
    # a listed proxy vouches for headers it sets, and SGLang's fields are in the body
    obj = generate(request_obj({"flow": "gold"}), http_request(peer="10.3.4.5"))
    assert obj.sampling_params["custom_params"]["kvadmit"] == {}
    obj = generate(request_obj({"flow": "gold"}), http_request([(SECRET_HEADER, b"guess")]))
    assert obj.sampling_params["custom_params"]["kvadmit"] == {}


def test_refuse_mode_raises_the_valueerror_sglang_answers_with_400(config):
    config({"untrusted_fields": "refuse"})
    with pytest.raises(ValueError, match=r"^kvadmit:untrusted_field: custom_params.kvadmit.flow "
                                         r"would raise"):
        generate(request_obj({"flow": "gold"}), http_request())


def test_offline_and_single_user_servers_are_untouched(config):
    config({"flows": {"gold": {}}})
    obj = generate(request_obj({"flow": "gold"}, priority=3), None)     # sglang.Engine: no HTTP
    assert obj.sampling_params["custom_params"]["kvadmit"] == {"flow": "gold"} and obj.priority == 3
    config({})                                                          # auto: honour
    obj = generate(request_obj({"flow": "gold"}, priority=3), http_request())
    assert obj.sampling_params["custom_params"]["kvadmit"] == {"flow": "gold"} and obj.priority == 3


@pytest.mark.parametrize("forged", [b"x-forwarded-for", b"forwarded", b"x-real-ip"])
def test_the_source_is_the_sockets_peer_never_a_header(config, forged):
    """From 127.0.0.1 (uvicorn rewrites its peer from X-Forwarded-For by default), a
    client claims the gateway's 127.0.0.2: the request SGLang's hook gets carries the
    socket's own peer, and only that is a proxy source."""
    config({"flows": {"gold": {}}, "trusted_proxies": ["127.0.0.2"]})
    trust = server_trust()
    value = b"for=127.0.0.2" if forged == b"forwarded" else b"127.0.0.2"
    request = http_request([(forged, value)], peer="127.0.0.1")
    if forged == b"x-forwarded-for":
        assert request.client.host == "127.0.0.2"       # uvicorn did take the header
    assert trust.source(request.scope["headers"], socket_peer(request.scope)) is None
    gateway = http_request(peer="127.0.0.2")
    assert trust.source([], socket_peer(gateway.scope)) == PROXY


def keyed_manager(key):
    manager = object.__new__(TokenizerManager)
    manager.server_args = type("ServerArgs", (), {"api_key": key})()
    return manager


def test_the_servers_api_key_binds_its_flow_whatever_the_request_claims(config):
    config({"flows": {"gold": {}, "tenant-a": {"api_keys": [key_digest("key-a")]}}})
    obj = request_obj({"flow": "gold"}, batch=True)
    wrapped = _wrap_fn(TokenizerManager.generate_request, before_generate_request, HookType.BEFORE)
    asyncio.run(wrapped(keyed_manager("key-a"), obj,
                        http_request([(b"authorization", b"Bearer key-a")])).aclose())
    for sp in obj.sampling_params:
        assert sp["custom_params"]["kvadmit"] == {"flow": "tenant-a"}
    # a key the server does not check binds nothing
    obj = request_obj({"flow": "gold"})
    asyncio.run(wrapped(keyed_manager("other"), obj,
                        http_request([(b"authorization", b"Bearer key-a")])).aclose())
    assert obj.sampling_params["custom_params"]["kvadmit"] == {}


def test_start_up_stops_on_keys_sglang_does_not_check(config):
    config({"flows": {"tenant-a": {"api_keys": [key_digest("key-a")]}}})
    with pytest.raises(ConfigError, match="the server checks none"):
        check_server(type("ServerArgs", (), {"api_key": None})())
    with pytest.raises(ConfigError, match="not the SHA-256 of any"):
        check_server(type("ServerArgs", (), {"api_key": "key-b"})())
    check_server(type("ServerArgs", (), {"api_key": "key-a"})())


def test_start_up_stops_where_sglang_would_serve_unscreened(config):
    config({"flows": {"gold": {}}, "trusted_proxies": ["127.0.0.2"]})
    with pytest.raises(ConfigError, match="--enable-http2 serves with Granian"):
        check_server(type("ServerArgs", (), {"api_key": None, "enable_http2": True})())
    with pytest.raises(ConfigError, match="--tokenizer-worker-num > 1"):
        check_server(type("ServerArgs", (), {"api_key": None, "tokenizer_worker_num": 2})())
    config({"untrusted_fields": "honour"})
    check_server(type("ServerArgs", (), {"api_key": None, "tokenizer_worker_num": 2})())
