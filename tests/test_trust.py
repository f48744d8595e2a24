"""Who may raise a request's claim (kvadmit.trust): the claim rule of every field, the
mode's resolution, the trusted sources, and the vLLM API server's middleware that
applies them (patches/vllm_slo_headers.py) on the ASGI level with a recording app."""
import asyncio
import hashlib
import json
import time
from types import SimpleNamespace

import pytest

from kvadmit import AdmissionConfig
from kvadmit.config import ConfigError
from kvadmit.flow_settings import key_digest
from kvadmit.request_fields import SCHEMA
from kvadmit.trust import SECRET_ENV, SECRET_HEADER, UNTRUSTED_KEY, Trust, resolved_mode
from kvadmit_patches.vllm_slo_headers import SloHeaderMiddleware, trust_of

NOW = 2_000_000_000.0
CONFIG = AdmissionConfig(default_ttft_slo_s=1.0, default_tpot_slo_s=0.05, max_queue_age_s=30.0,
                         flows={"gold": {"weight": 4}})
# field -> (values that raise the claim, values that lower it or leave it)
CLAIMS = {
    "ttft_slo_s": ([0.5, 0.001], [1.0, 2.0, 0]),
    "tpot_slo_s": ([0.01], [0.05, 0.5, 0]),
    "session": (["agent-7", 3], []),
    "deadline_s": ([NOW + 0.5], [NOW + 5.0]),
    "ttl_s": ([60.0, 0], [10.0, 30.0]),
    "flow": (["gold", "7"], []),
    "sheddable": ([], [True, False]),
    "max_queue_delay_s": ([], [0.1, 5.0]),
    "kv_hold_s": ([], [0, 5.0, 86400]),    # a hold only releases KV sooner: never a raise
}


def test_every_field_has_its_claim_rule_tested():
    assert set(CLAIMS) == {f.name for f in SCHEMA}


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_a_field_raises_the_claim_only_past_the_servers_default(name):
    trust = Trust.of(CONFIG, {})
    raising, lowering = CLAIMS[name]
    for v in raising:
        assert trust.raised({name: v}, NOW) == [name], v
    for v in lowering:
        assert trust.raised({name: v}, NOW) == [], v


def test_without_server_defaults_any_target_or_ttl_is_judged_against_none():
    trust = Trust.of(AdmissionConfig(flows={"a": {}}), {})
    assert trust.raised({"ttft_slo_s": 30.0, "deadline_s": NOW + 60}, NOW) == ["ttft_slo_s", "deadline_s"]
    # no max_queue_age_s: every TTL shortens the wait (none)
    assert trust.raised({"ttl_s": 5.0, "ttft_slo_s": 0}, NOW) == []


def test_a_malformed_value_is_left_for_the_engine_to_refuse_as_invalid():
    assert Trust.of(CONFIG, {}).raised({"flow": "", "ttft_slo_s": "soon", "nope": 1}, NOW) == []


def test_the_simulators_columns_follow_the_same_rules():
    trust = Trust.of(CONFIG, {})
    assert trust.raised_columns({"flow": 3, "session": -1, "ttl_s": -1.0, "ttft_slo_s": 0.2}, -1) \
        == ["ttft_slo_s", "flow", "priority"]
    assert trust.raised_columns({"flow": -1, "sheddable": True, "ttl_s": 5.0}, 2) == []


def test_auto_honours_everything_until_a_claim_could_take_from_others():
    assert resolved_mode(AdmissionConfig(), False) == "honour"
    # an agent window alone keeps a single user's sessions
    assert Trust.of(AdmissionConfig(agent_window=True), {}).mode == "honour"
    for changes in ({"flows": {"a": {}}}, {"queue_order": "priority"}, {"queue_order": "deadline"},
                    {"trusted_proxies": ["10.0.0.0/8"]}):
        assert Trust.of(AdmissionConfig(**changes), {}).mode == "ignore", changes
    assert Trust.of(AdmissionConfig(), {SECRET_ENV: "s3cret"}).mode == "ignore"
    for mode in ("honour", "ignore", "refuse"):
        assert resolved_mode(AdmissionConfig(untrusted_fields=mode, flows={"a": {}}), True) == mode


def test_trusted_sources_are_the_gateway_secret_and_the_listed_proxies():
    trust = Trust.of(AdmissionConfig(trusted_proxies=["10.1.0.0/16", "::1"]), {SECRET_ENV: "s3cret"})
    assert trust.trusted([(b"X-KVAdmit-Gateway-Secret", b"s3cret")], "192.0.2.1")
    assert not trust.trusted([(SECRET_HEADER, b"guess")], "192.0.2.1")
    assert trust.trusted([], "10.1.200.3") and trust.trusted([], "::1")
    assert not trust.trusted([], "10.2.0.1") and not trust.trusted([], "not-an-ip")
    assert not trust.trusted([], None)
    assert not Trust.of(AdmissionConfig(), {}).trusted([(SECRET_HEADER, b"")], "127.0.0.1")


def test_trusted_proxies_must_be_addresses():
    with pytest.raises(ConfigError, match=r"trusted_proxies\[1\]='10.0.0.300'"):
        AdmissionConfig(trusted_proxies=["10.0.0.1", "10.0.0.300"])
    with pytest.raises(ConfigError, match="trusted_proxies='10.0.0.1': must be a list"):
        AdmissionConfig(trusted_proxies="10.0.0.1")


# -- the vLLM API server's middleware ---------------------------------------------------
def call(trust, doc, headers=(), path="/v1/completions", peer="192.0.2.9", method="POST",
         socket_peer=True):
    """The middleware in front of a recording app, behind what uvicorn puts in front of
    an app: kvadmit's socket-peer patch (unless `socket_peer` is False) and uvicorn's
    own ProxyHeadersMiddleware with its default FORWARDED_ALLOW_IPS (127.0.0.1), on a
    connection from `peer`: (what the app got, or None, the response's status and body
    when the middleware answered itself)."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    from kvadmit_patches.asgi_socket_peer import SocketPeer
    body = json.dumps(doc).encode()
    scope = {"type": "http", "method": method, "path": path, "client": (peer, 5555),
             "headers": [(b"content-length", str(len(body)).encode()), *headers]}
    seen, sent = {}, []
    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def app(scope, receive, send):
        m = await receive()
        seen["doc"], seen["headers"] = json.loads(m["body"]), dict(scope["headers"])
        seen["client"] = scope["client"]

    async def receive():
        return chunks.pop(0)

    async def send(message):
        sent.append(message)
    server = ProxyHeadersMiddleware(SloHeaderMiddleware(app, trust), trusted_hosts="127.0.0.1")
    asyncio.run((SocketPeer(server) if socket_peer else server)(scope, receive, send))
    if sent:
        return None, sent[0]["status"], json.loads(sent[1]["body"])
    return seen, None, None


def untrusted_fields_total(field):
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("kvadmit_untrusted_fields_total", {"field": field}) or 0.0


def test_an_untrusted_client_loses_its_raises_and_keeps_what_lowers_its_claim():
    trust = Trust.of(CONFIG, {SECRET_ENV: "s3cret"})
    before = untrusted_fields_total("kvadmit_flow")
    doc = {"prompt": [5], "priority": -3, "vllm_xargs": {
        "kvadmit_session": "agent-1", "kvadmit_ttft_slo_s": 5.0, "kvadmit_ttl_s": 10, "other": 1}}
    seen, _, _ = call(trust, doc, [(b"x-gateway-inference-fairness-id", b"gold"),
                                   (b"x-kvadmit-sheddable", b"true")])
    assert "priority" not in seen["doc"]
    assert seen["doc"]["vllm_xargs"] == {"kvadmit_ttft_slo_s": 5.0, "kvadmit_ttl_s": 10, "other": 1,
                                         "kvadmit_sheddable": "true"}
    assert untrusted_fields_total("kvadmit_flow") == before + 1
    assert untrusted_fields_total("kvadmit_session") >= 1 and untrusted_fields_total("priority") >= 1
    # vLLM's own session id stays, marked so that kvadmit does not take it; counted
    sessions = untrusted_fields_total("session_id")
    seen, _, _ = call(trust, {"prompt": [5]}, [(b"X-Session-ID", b"agent-9")])
    assert seen["doc"]["vllm_xargs"] == {UNTRUSTED_KEY: True}
    assert untrusted_fields_total("session_id") == sessions + 1
    # a lower priority than the default is the client's to choose
    seen, _, _ = call(trust, {"prompt": [5], "priority": 4})
    assert seen["doc"]["priority"] == 4


@pytest.mark.parametrize("mode", ["ignore", "refuse"])
@pytest.mark.parametrize("name", sorted(n for n, (raising, _) in CLAIMS.items() if raising))
def test_each_raising_field_from_an_untrusted_client_is_ignored_or_refused(name, mode):
    """Each field that can raise a claim, sent by a client in vllm_xargs with a raising
    value (a deadline relative to now), never reaches the engine."""
    trust = Trust.of(CONFIG.replace(untrusted_fields=mode), {})
    value = CLAIMS[name][0][0]
    if name == "deadline_s":
        value = time.time() + 0.5
    key = "kvadmit_" + name
    before = untrusted_fields_total(key)
    seen, status, body = call(trust, {"prompt": [5], "vllm_xargs": {key: value}})
    assert untrusted_fields_total(key) == before + 1
    if mode == "ignore":
        assert key not in seen["doc"]["vllm_xargs"]
    else:
        assert seen is None and status == 400 and body["error"]["param"] == key


def test_a_gateway_with_the_secret_is_trusted_its_headers_win_and_the_secret_goes_no_further():
    trust = Trust.of(CONFIG, {SECRET_ENV: "s3cret"})
    doc = {"prompt": [5], "priority": -3, "vllm_xargs": {"kvadmit_flow": "client-claims",
                                                         "kvadmit_session": "a1"}}
    seen, _, _ = call(trust, doc, [(b"x-gateway-inference-fairness-id", b"gold"),
                                   (SECRET_HEADER, b"s3cret")])
    assert seen["doc"]["priority"] == -3
    assert seen["doc"]["vllm_xargs"] == {"kvadmit_flow": "gold", "kvadmit_session": "a1"}
    assert SECRET_HEADER not in seen["headers"]
    assert seen["headers"][b"content-length"] == str(len(json.dumps(seen["doc"]))).encode()
    # a listed proxy vouches for the headers it sets, not for the body it forwards
    proxied = Trust.of(CONFIG.replace(trusted_proxies=["192.0.2.0/24"]), {})
    seen, _, _ = call(proxied, doc, [(b"x-gateway-inference-fairness-id", b"gold")])
    assert seen["doc"]["vllm_xargs"] == {"kvadmit_flow": "gold"} and "priority" not in seen["doc"]
    seen, _, _ = call(proxied, doc)
    assert seen["doc"]["vllm_xargs"] == {}


def test_refuse_mode_answers_400_naming_the_fields_and_the_engine_never_sees_it():
    trust = Trust.of(CONFIG.replace(untrusted_fields="refuse"), {})
    seen, status, body = call(trust, {"prompt": [5], "vllm_xargs": {"kvadmit_flow": "gold"}},
                              path="/v1/chat/completions")
    assert seen is None and status == 400
    assert body["error"]["message"].startswith("kvadmit:untrusted_field: kvadmit_flow would raise")
    assert body["error"]["param"] == "kvadmit_flow"
    # nothing to screen: it passes
    seen, status, _ = call(trust, {"prompt": [5], "vllm_xargs": {"kvadmit_sheddable": True}})
    assert status is None and seen["doc"]["vllm_xargs"] == {"kvadmit_sheddable": True}


def test_every_json_post_is_screened_not_only_completions():
    trust = Trust.of(CONFIG, {})
    seen, _, _ = call(trust, {"input": "x", "priority": -1}, path="/v1/embeddings")
    assert seen["doc"] == {"input": "x"}          # nothing added where nothing was asked


def test_honour_passes_every_field_as_before():
    trust = Trust.of(AdmissionConfig(), {})
    doc = {"prompt": [5], "priority": -3, "vllm_xargs": {"kvadmit_flow": "x"}}
    seen, _, _ = call(trust, doc, [(b"x-gateway-inference-fairness-id", b"gold")])
    assert seen["doc"]["priority"] == -3 and seen["doc"]["vllm_xargs"]["kvadmit_flow"] == "x"


def test_the_servers_trust_comes_from_its_additional_config():
    args = SimpleNamespace(scheduler_cls="kvadmit.vllm.Scheduler",
                           additional_config={"kvadmit": {"flows": {"a": {}}}})
    assert trust_of(args).mode == "ignore"
    args.additional_config = {"kvadmit": json.dumps({"untrusted_fields": "refuse"})}
    assert trust_of(args).mode == "refuse"
    assert trust_of(SimpleNamespace(scheduler_cls=None, additional_config={})) is None
    assert time.time() < NOW          # the test's deadlines are ahead of now


# -- the simulator's workloads ----------------------------------------------------------
def test_the_simulator_ignores_an_untrusted_workloads_raises():
    """A burst of eight requests claiming flow 1, whose queue the config caps at one:
    trusted, the flow's cap refuses most of them; from untrusted clients the claim is
    ignored (the flow cap does not apply) and counted, their lower claims kept."""
    from kvadmit.simulate.engine import EngineShape, run_native
    from kvadmit.simulate.steptime import CPU_TINY
    from kvadmit.simulate.workload import Workload

    n = 8
    w = Workload(name="burst", arrival_s=[0.0] * n, prompt_tokens=[64] * n,
                 output_tokens=[16] * n, max_tokens=[16] * n, priority=[-1] * n,
                 flow=[1] * n, sheddable=[False] * (n - 1) + [True])
    shape = EngineShape(num_blocks=64, block_size=16, max_model_len=512, max_num_seqs=2,
                        max_num_batched_tokens=512)
    config = AdmissionConfig(flows={"1": {"max_queued_requests": 1}})
    trusted = run_native(w, config, shape, CPU_TINY).totals
    assert trusted.rejected >= 4
    untrusted = w.__class__(**{**w.__dict__, "trusted": [False] * n})
    screened = untrusted.screened(config)
    assert screened.meta["untrusted_fields"] == {"flow": n, "priority": n}
    assert screened.flow == [-1] * n and screened.priority == [0] * n
    assert screened.sheddable == w.sheddable
    totals = run_native(untrusted, config, shape, CPU_TINY).totals
    assert totals.rejected == 0 and totals.finished == n
    # honour: the same workload as it is
    assert untrusted.screened(config.replace(untrusted_fields="honour")) is untrusted


# -- the boundary cannot be forged: the socket's peer, never a header ---------------------
GATEWAY = "127.0.0.2"
PROXIED = CONFIG.replace(trusted_proxies=[GATEWAY])
CLAIM = {"prompt": [5], "vllm_xargs": {"kvadmit_flow": "gold"}}


@pytest.mark.parametrize("forged", [
    [(b"x-forwarded-for", GATEWAY.encode())],
    [(b"x-forwarded-for", b"203.0.113.1, " + GATEWAY.encode())],
    [(b"x-forwarded-for", b"203.0.113.1"), (b"x-forwarded-for", GATEWAY.encode())],
    [(b"forwarded", b"for=" + GATEWAY.encode())],
    [(b"x-real-ip", GATEWAY.encode())],
])
def test_a_client_that_claims_the_gateways_address_in_a_header_is_not_trusted(forged):
    """A client on 127.0.0.1, which uvicorn trusts by default to set X-Forwarded-For
    (a sidecar, a router on the host, kubectl port-forward), claims the gateway's
    address: uvicorn rewrites the peer from X-Forwarded-For, and kvadmit still reads the
    socket's own."""
    trust = Trust.of(PROXIED, {})
    before = untrusted_fields_total("kvadmit_flow")
    seen, _, _ = call(trust, CLAIM, forged, peer="127.0.0.1")
    assert "kvadmit_flow" not in seen["doc"]["vllm_xargs"]
    assert untrusted_fields_total("kvadmit_flow") == before + 1
    if forged[-1][0] == b"x-forwarded-for":       # the header did move uvicorn's peer
        assert seen["client"][0] == GATEWAY


def test_the_gateways_own_connection_vouches_for_its_headers_not_the_body_it_forwards():
    trust = Trust.of(PROXIED, {})
    header = [(b"x-gateway-inference-fairness-id", b"gold"), (b"x-forwarded-for", b"203.0.113.7")]
    seen, _, _ = call(trust, {"prompt": [5]}, header, peer=GATEWAY)
    assert seen["doc"]["vllm_xargs"]["kvadmit_flow"] == "gold"
    before = untrusted_fields_total("kvadmit_flow")
    seen, _, _ = call(trust, {**CLAIM, "priority": -4}, peer=GATEWAY)     # a caller's body
    assert "kvadmit_flow" not in seen["doc"]["vllm_xargs"] and "priority" not in seen["doc"]
    assert untrusted_fields_total("kvadmit_flow") == before + 1
    seen, _, _ = call(trust, {"prompt": [5], "vllm_xargs": {"kvadmit_flow": "x"}}, header,
                      peer=GATEWAY)
    assert seen["doc"]["vllm_xargs"]["kvadmit_flow"] == "gold"             # its header wins
    # a dual-stack listener reports the gateway's IPv4 address mapped into IPv6
    seen, _, _ = call(trust, {"prompt": [5]}, header, peer="::ffff:" + GATEWAY)
    assert seen["doc"]["vllm_xargs"]["kvadmit_flow"] == "gold"


def test_without_the_socket_peer_no_address_is_trusted():
    """An ASGI server kvadmit did not patch records no socket peer: scope["client"]
    alone (here the gateway's very address) is never enough."""
    seen, _, _ = call(Trust.of(PROXIED, {}), CLAIM, peer=GATEWAY, socket_peer=False)
    assert "kvadmit_flow" not in seen["doc"]["vllm_xargs"]


def test_uvicorns_app_loading_records_the_socket_peer_once_patched():
    import uvicorn

    from kvadmit_patches import asgi_socket_peer
    asgi_socket_peer.apply()
    asgi_socket_peer.apply()                  # once: a second apply finds its mark

    async def app(scope, receive, send):
        pass
    config = uvicorn.Config(app, proxy_headers=True)
    config.load()
    assert asgi_socket_peer.installed()
    assert isinstance(config.loaded_app, asgi_socket_peer.SocketPeer)
    assert not isinstance(config.loaded_app.app, asgi_socket_peer.SocketPeer)


def test_trusted_proxies_without_the_socket_peer_patch_stop_start_up(monkeypatch):
    from kvadmit_patches import asgi_socket_peer
    args = SimpleNamespace(scheduler_cls="kvadmit.vllm.Scheduler",
                           additional_config={"kvadmit": {"trusted_proxies": [GATEWAY]}})
    monkeypatch.setattr(asgi_socket_peer, "installed", lambda: False)
    with pytest.raises(ConfigError, match="trusted_proxies needs the connection's own peer"):
        trust_of(args)


def test_the_secret_is_compared_as_a_digest_and_removed_from_every_method():
    trust = Trust.of(CONFIG, {SECRET_ENV: "s3cret"})
    assert trust.secret == hashlib.sha256(b"s3cret").digest()
    assert not trust.trusted([(SECRET_HEADER, b"s3cre")], None)
    assert trust.trusted([(SECRET_HEADER, b" s3cret ")], None)
    for method in ("GET", "POST"):
        seen, _, _ = call(trust, {"prompt": [5]}, [(SECRET_HEADER, b"s3cret")], method=method)
        assert SECRET_HEADER not in seen["headers"], method


# -- flows bound to API keys --------------------------------------------------------------
KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"
KEYED = CONFIG.replace(flows={
    "tenant-a": {"api_keys": [key_digest(KEY_A)], "min_priority": -2},
    "tenant-b": {"api_keys": [key_digest(KEY_B)], "max_queued_requests": 1}})


def bearer(key):
    return (b"authorization", b"Bearer " + key.encode())


@pytest.mark.parametrize("secret", [False, True])
def test_a_request_with_tenant_as_key_is_tenant_as_whatever_it_claims(secret):
    """From a client or from the trusted gateway alike: header, flat and nested body
    claims of another flow are overridden (and counted); the priority stops at the
    key's min_priority."""
    trust = Trust.of(KEYED, {SECRET_ENV: "s3cret"})
    gateway = [(SECRET_HEADER, b"s3cret")] if secret else []
    before = untrusted_fields_total("kvadmit_flow")
    doc = {"prompt": [5], "priority": -5,
           "vllm_xargs": {"kvadmit_flow": "tenant-b", "kvadmit": {"flow": "tenant-b"}}}
    seen, _, _ = call(trust, doc, [bearer(KEY_A), (b"x-gateway-inference-fairness-id",
                                                   b"tenant-b"), *gateway])
    assert seen["doc"]["vllm_xargs"]["kvadmit_flow"] == "tenant-a"
    assert "flow" not in seen["doc"]["vllm_xargs"]["kvadmit"]
    assert seen["doc"]["priority"] == -2
    assert untrusted_fields_total("kvadmit_flow") == before + 1
    # within what the key allows: kept, nothing counted
    seen, _, _ = call(trust, {"prompt": [5], "priority": -1,
                              "vllm_xargs": {"kvadmit_flow": "tenant-a"}}, [bearer(KEY_A)])
    assert seen["doc"]["priority"] == -1 and seen["doc"]["vllm_xargs"]["kvadmit_flow"] == "tenant-a"
    assert untrusted_fields_total("kvadmit_flow") == before + 1
    # tenant B's key allows no raise: a priority of -1 from its client goes
    seen, _, _ = call(trust, {"prompt": [5], "priority": -1}, [bearer(KEY_B)])
    assert seen["doc"]["priority"] == 0 and seen["doc"]["vllm_xargs"]["kvadmit_flow"] == "tenant-b"


def test_a_key_no_flow_lists_and_other_schemes_bind_nothing():
    trust = Trust.of(KEYED, {})
    for auth in [bearer("another-key"), (b"authorization", b"Basic " + KEY_A.encode()),
                 (b"x-api-key", KEY_A.encode())]:
        seen, _, _ = call(trust, {"prompt": [5], "vllm_xargs": {"kvadmit_flow": "tenant-a"}}, [auth])
        assert "kvadmit_flow" not in seen["doc"]["vllm_xargs"], auth


def test_refuse_mode_refuses_a_keyed_request_that_claims_another_flow():
    trust = Trust.of(KEYED.replace(untrusted_fields="refuse"), {})
    seen, status, body = call(trust, {"prompt": [5], "vllm_xargs": {"kvadmit_flow": "tenant-a"}},
                              [bearer(KEY_B)])
    assert seen is None and status == 400 and body["error"]["param"] == "kvadmit_flow"
    seen, status, _ = call(trust, {"prompt": [5]}, [bearer(KEY_B)])
    assert status is None and seen["doc"]["vllm_xargs"] == {"kvadmit_flow": "tenant-b"}


def test_api_keys_are_digests_one_flow_each_and_must_be_the_servers_own():
    with pytest.raises(ConfigError, match=r"flows\['a'\].api_keys\[0\]: must be \"sha256:\""):
        AdmissionConfig(flows={"a": {"api_keys": [KEY_A]}})
    assert KEY_A not in str(pytest.raises(ConfigError, AdmissionConfig,
                                          flows={"a": {"api_keys": [KEY_A]}}).value)
    with pytest.raises(ConfigError, match="already bound to flow 'a'"):
        AdmissionConfig(flows={"a": {"api_keys": [key_digest(KEY_A)]},
                               "b": {"api_keys": [key_digest(KEY_A)]}})
    with pytest.raises(ConfigError, match=r"min_priority=1: out of range"):
        AdmissionConfig(flows={"a": {"min_priority": 1}})
    keyed = {"kvadmit": {"flows": {"a": {"api_keys": [key_digest(KEY_A)]}}}}
    args = SimpleNamespace(scheduler_cls="kvadmit.vllm.Scheduler", additional_config=keyed,
                           api_key=None)
    with pytest.raises(ConfigError, match="the server checks none: start it with --api-key"):
        trust_of(args)
    args.api_key = [KEY_B]
    with pytest.raises(ConfigError, match=r"flows\['a'\].api_keys has sha256:"):
        trust_of(args)
    args.api_key = [KEY_B, KEY_A]
    assert trust_of(args).bound([bearer(KEY_A)]).flow == "a"


def test_a_body_vllm_cannot_encode_or_parse_is_a_400_not_a_500():
    """A lone surrogate in vllm_xargs (vLLM fails encoding it for the engine core: 500)
    is refused naming the key; a body nested past the JSON parser's depth is passed on
    as it is, for vLLM's own 400."""
    trust = Trust.of(CONFIG, {})
    doc = json.loads('{"prompt": [5], "vllm_xargs": {"other": 1, "kvadmit_ttl_s": ["\\ud800"]}}')
    seen, status, body = call(trust, doc)
    assert seen is None and status == 400
    assert body["error"]["param"] == "vllm_xargs.kvadmit_ttl_s"
    assert body["error"]["message"].startswith("kvadmit:invalid: vllm_xargs.kvadmit_ttl_s is not")
    for prompt in ([5, 10**30], [[5], [6, -10**20]]):
        seen, status, body = call(trust, {"prompt": prompt})
        assert status == 400 and body["error"]["param"] == "prompt", prompt
    seen, status, _ = call(trust, {"prompt": [[5], [2**63 - 1]]})
    assert status is None
    from kvadmit_patches.vllm_slo_headers import _json_object
    assert _json_object(b"[" * 100_000) is None


@pytest.mark.parametrize("priority", ["-5", " -5 ", "-5.0", -5.0, "-5e0"])
def test_a_priority_vllm_reads_as_an_integer_is_screened_in_any_spelling(priority):
    trust = Trust.of(CONFIG, {})
    seen, _, _ = call(trust, {"prompt": [5], "priority": priority})
    assert "priority" not in seen["doc"]
    seen, _, _ = call(Trust.of(KEYED, {}), {"prompt": [5], "priority": priority}, [bearer(KEY_A)])
    assert seen["doc"]["priority"] == -2


@pytest.mark.parametrize("mode", ["ignore", "refuse"])
def test_a_vllm_xargs_that_is_not_an_object_hides_nothing(mode):
    """A route that does not read vllm_xargs (embeddings) would ignore the junk and
    keep the priority: screened or bound, it is refused naming vllm_xargs."""
    for trust, headers in ((Trust.of(CONFIG.replace(untrusted_fields=mode), {}), []),
                           (Trust.of(KEYED, {}), [bearer(KEY_A)])):
        seen, status, body = call(trust, {"input": "x", "priority": -5, "vllm_xargs": 1},
                                  headers, path="/v1/embeddings")
        assert seen is None and status == 400 and body["error"]["param"] == "vllm_xargs"


def test_the_token_in_routes_extra_args_are_screened_and_bound():
    """vLLM's /inference/v1/generate takes sampling_params.extra_args as they are sent."""
    doc = {"token_ids": [5], "sampling_params": {"extra_args": {"kvadmit_flow": "gold"}}}
    seen, _, _ = call(Trust.of(CONFIG, {}), json.loads(json.dumps(doc)),
                      path="/inference/v1/generate")
    assert seen["doc"]["sampling_params"]["extra_args"] == {}
    seen, _, _ = call(Trust.of(KEYED, {}), json.loads(json.dumps(doc)), [bearer(KEY_B)],
                      path="/inference/v1/generate")
    assert seen["doc"]["sampling_params"]["extra_args"] == {"kvadmit_flow": "tenant-b"}


def test_a_form_that_claims_vllm_xargs_or_a_priority_is_refused_where_it_cannot_be_screened():
    form = (b'--b\r\nContent-Disposition: form-data; name="vllm_xargs"\r\n\r\n'
            b'{"kvadmit_flow": "gold"}\r\n--b--\r\n')
    scope = {"type": "http", "method": "POST", "path": "/v1/audio/transcriptions",
             "client": ("192.0.2.9", 5), "headers": [(b"content-type",
                                                      b"multipart/form-data; boundary=b")]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": form, "more_body": False}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        sent.append("app")
    asyncio.run(SloHeaderMiddleware(app, Trust.of(CONFIG, {}))(scope, receive, send))
    assert sent[0]["status"] == 400 and json.loads(sent[1]["body"])["error"]["param"] == "vllm_xargs"
    sent.clear()
    asyncio.run(SloHeaderMiddleware(app, Trust.of(CONFIG, {SECRET_ENV: "s"}))(
        {**scope, "headers": scope["headers"] + [(SECRET_HEADER, b"s")]}, receive, send))
    assert sent == ["app"]                          # the gateway's form passes


def test_the_secret_is_removed_from_websockets_too():
    seen = {}

    async def app(scope, receive, send):
        seen.update(dict(scope["headers"]))
    scope = {"type": "websocket", "path": "/v1/realtime", "headers": [(SECRET_HEADER, b"s")]}
    asyncio.run(SloHeaderMiddleware(app, Trust.of(CONFIG, {}))(scope, None, None))
    assert SECRET_HEADER not in seen
