"""Bad input, fuzzed (issue 53), without an engine: kvadmit's per-request field schema
(kvadmit.request_fields) and the vLLM API server's header and trust middleware
(patches/vllm_slo_headers.py) on arbitrary input.

- Every SCHEMA field's parse, given any JSON value (wrong types, huge integers, NaN and
  infinities, unicode, 64 KiB strings), returns a value in the field's range or raises
  FieldError naming the field; never another exception (the adapter would answer it
  without naming the field, and the middleware's trust check would raise: a 500).
- The middleware, in front of a recording ASGI app, under each trust mode (none,
  auto, honour, ignore, refuse; with and without the gateway secret, trusted proxies
  and, where the config has them, an API key bound to a flow), given
  arbitrary headers (repeated, latin-1 bytes, 64 KiB values, the gateway headers with
  junk) and bodies (JSON objects with junk vllm_xargs and priority, other JSON, not
  JSON): it never raises, and either passes a body on (a JSON object where the input
  was one, whose kvadmit fields then parse or are refused naming the field) or answers
  400 naming a field.

The assertions are on what goes in and out (HTTP scope, body, status), not on how the
middleware decides, so they hold however it finds the peer. Examples per property: the
profiles in tests/conftest.py (CI: 300)."""
import asyncio
import hashlib
import json
import math
import time

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from kvadmit import AdmissionConfig
from kvadmit.request_fields import (FLAT_PREFIX, HEADERS, KEY, MAX_TPOT_S, MAX_TTFT_S,
                                    MAX_TTL_S, MIN_DEADLINE_UNIX, SCHEMA, FieldError,
                                    check_int, from_extra_args)
from kvadmit.trust import PEER_SCOPE_KEY, SECRET_ENV, SECRET_HEADER, Trust
from kvadmit_patches.vllm_slo_headers import SloHeaderMiddleware

NOW = 2_000_000_000.0
SECRET = "s3cret"
API_KEY = "fuzz-key"
FIELD_NAMES = {f.name for f in SCHEMA}
KB64 = 64 * 1024


# -- values --------------------------------------------------------------------------
def _long(chars: str):
    """Strings of one repeated character, up to 64 KiB (hypothesis draws long text slowly)."""
    return st.builds(lambda c, n: c * n, st.sampled_from(chars), st.integers(0, KB64))


HUGE_INTS = st.sampled_from([2**62, 2**62 - 1, 2**63, -2**63, 2**64, 10**30, 10**400,
                             -10**400, 10**4299])
NUMBERS = st.one_of(st.integers(), HUGE_INTS, st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 0.0, -0.0, 1e-300, 1e308, NOW, NOW + 1.0]))
NUMERIC_TEXT = st.sampled_from(["1", "7", "0", "-1", "1e400", "-1e400", "nan", "NaN", "inf",
                                "-inf", "1_000", " 7 ", "0x10", "true", "false", "TRUE",
                                "1500ms", "30s", "2m", "1h", "", " ", "\x00", "\u0663",
                                "\ud800", "7\u200b", "\uff17"])
TEXT = st.one_of(st.text(), NUMERIC_TEXT, _long("0123456789x\u00e9\u4e2d"))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)


def _seconds_in(hi):
    return lambda v: isinstance(v, float) and 0.0 <= v <= hi


# field -> whether a parsed value is one the core can take
VALID = {
    "ttft_slo_s": _seconds_in(MAX_TTFT_S),
    "tpot_slo_s": _seconds_in(MAX_TPOT_S),
    "session": lambda v: type(v) is int and 0 <= v < 2**63,
    "deadline_s": lambda v: (isinstance(v, float) and math.isfinite(v)
                             and MIN_DEADLINE_UNIX <= v <= NOW + MAX_TTFT_S),
    "ttl_s": _seconds_in(MAX_TTL_S),
    "flow": lambda v: type(v) is int and 0 <= v < 2**63,
    "sheddable": lambda v: type(v) is bool,
    "max_queue_delay_s": _seconds_in(MAX_TTFT_S),
    "kv_hold_s": _seconds_in(MAX_TTL_S),
}


def test_every_field_has_its_valid_range_here():
    assert set(VALID) == FIELD_NAMES


@pytest.mark.parametrize("field", SCHEMA, ids=lambda f: f.name)
@given(value=JSON_VALUES)
@example(value=10**400)
@example(value="1" * 5000)
@example(value=float("nan"))
def test_a_field_parses_any_json_value_or_names_itself(field, value):
    spelled = FLAT_PREFIX + field.name
    try:
        parsed = field.parse(value, spelled, NOW)
    except FieldError as e:
        assert spelled in str(e), (value, str(e))
        return
    assert VALID[field.name](parsed), (value, parsed)


@given(extra=st.dictionaries(
    st.one_of(st.sampled_from([FLAT_PREFIX + n for n in sorted(FIELD_NAMES)] + [KEY]), st.text()),
    st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(sorted(FIELD_NAMES) + ["nope"]),
                                           JSON_VALUES, max_size=3)),
    max_size=6))
def test_vllm_extra_args_parse_or_name_a_key_they_carry(extra):
    """The adapter's reading of SamplingParams.extra_args (vllm_xargs): fields, or a
    FieldError naming one of the keys the request carried."""
    try:
        from_extra_args(extra, NOW)
    except FieldError as e:
        assert any(k in str(e) for k in extra), (extra, str(e))


@given(value=JSON_VALUES, name=st.sampled_from(["priority", "max_tokens"]))
def test_a_requests_integers_are_checked_or_named(value, name):
    try:
        assert type(check_int(value, name)) is int
    except FieldError as e:
        assert str(e).startswith(name + "=") and e.field == name


# -- the middleware ------------------------------------------------------------------
GATEWAY = sorted(h.decode() for h in HEADERS) + [SECRET_HEADER.decode()]
HEADER_NAMES = st.one_of(
    st.sampled_from(GATEWAY + ["x-forwarded-for", "forwarded", "x-real-ip", "x-session-id",
                               "content-type", "content-length", "authorization"]),
    st.text("abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=20),
).map(lambda n: n.upper() if len(n) % 3 == 0 else n)        # names in any case
HEADER_VALUES = st.one_of(
    st.binary(max_size=40),
    NUMERIC_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([SECRET.encode(), b" " + SECRET.encode() + b" ", b"192.0.2.9", b"::1",
                     b"Bearer " + API_KEY.encode(), b"bearer  " + API_KEY.encode(), b"Bearer",
                     b"for=192.0.2.9;proto=https", b"10.0.0.1, 192.0.2.9", b"gold", b"250"]),
    st.builds(lambda c, n: c * n, st.sampled_from([b"7", b"a", b"\xe9", b" "]),
              st.integers(KB64 - 8, KB64 + 8)),
)
AUTHORIZATION = st.sampled_from([[], [(b"authorization", b"Bearer " + API_KEY.encode())],
                                 [(b"Authorization", b"Bearer nope")]])
HEADER_LISTS = st.tuples(st.lists(st.tuples(HEADER_NAMES.map(str.encode), HEADER_VALUES),
                                  max_size=8), AUTHORIZATION).map(
    lambda t: t[0] + t[1] + t[0][:1])                         # a repeated header, where any


XARGS_KEYS = st.one_of(st.sampled_from([FLAT_PREFIX + n for n in sorted(FIELD_NAMES)]
                                       + [KEY, "session_id", "kvadmit_untrusted", "other"]),
                       st.text(max_size=12))
# values kvadmit takes, some of which raise a claim over the test's defaults (a flow, a
# session, a tighter target, a longer TTL)
TAKEN = st.sampled_from(["gold", "7", 7, "agent-1", 0.5, 0.001, 2.0, 0, 60.0, True, "true"])
XARGS = st.one_of(st.none(), JSON_VALUES,
                  st.dictionaries(XARGS_KEYS, st.one_of(TAKEN, JSON_VALUES), max_size=5),
                  st.dictionaries(st.sampled_from([FLAT_PREFIX + n for n in sorted(FIELD_NAMES)]),
                                  TAKEN, min_size=1, max_size=3))
PRIORITIES = st.one_of(st.integers(-5, 5), NUMBERS, TEXT, st.none(), st.booleans())
OMIT = object()
DOCS = st.fixed_dictionaries({
    "prompt": st.one_of(st.lists(st.integers(-5, 2**40), max_size=5), st.text(max_size=10)),
    "vllm_xargs": st.one_of(st.just(OMIT), XARGS),
    "priority": st.one_of(st.just(OMIT), PRIORITIES),
    "session_id": st.one_of(st.just(OMIT), JSON_VALUES),
    "max_tokens": st.one_of(st.just(OMIT), NUMBERS),
}).map(lambda d: {k: v for k, v in d.items() if v is not OMIT})
# JSON a client may send that is not an object, or not JSON at all; nesting past the
# parser's recursion limit; integers past Python's 4300 digits; invalid UTF-8.
JUNK_BODIES = st.one_of(
    st.binary(max_size=60),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"vllm_xargs": NaN}', b'{"priority": Infinity}',
                     b"[" * 100_000, b'{"a":' * 50_000, b'{"priority": ' + b"9" * 5000 + b"}",
                     b'{"prompt": "\xff\xfe"}', b'\xef\xbb\xbf{"prompt": [1]}']),
)
JSON_DOCS = DOCS.map(lambda d: json.dumps(d).encode())        # NaN as the token NaN
# three in four a request body's JSON object (one_of would draw one in four: JUNK_BODIES
# is three strategies)
BODIES = st.integers(0, 3).flatmap(lambda k: JUNK_BODIES if k == 0 else JSON_DOCS)


def _json_object(body: bytes):
    """The body's JSON object (an empty body is an empty one), else None."""
    try:
        doc = json.loads(body or b"{}")
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def trust_of(mode, secret, proxies, api_key=False):
    """A server's trust rule: mode None is a server without kvadmit's screening. With
    `api_key`, flow gold is bound to the API key API_KEY, where the config has API keys."""
    if mode is None:
        return None
    flows = {"gold": {"weight": 4}, "7": {}}
    if api_key:
        flows["gold"].update(api_keys=[API_KEY_DIGEST], min_priority=-2)
    config = AdmissionConfig(untrusted_fields=mode, trusted_proxies=proxies, flows=flows,
                             default_ttft_slo_s=1.0, max_queue_age_s=30.0)
    return Trust.of(config, {SECRET_ENV: SECRET} if secret else {})


API_KEY_DIGEST = "sha256:" + hashlib.sha256(API_KEY.encode()).hexdigest()


MODES = [None, "auto", "honour", "ignore", "refuse"]


def trusts(mode):
    """Servers of `mode`, with and without the secret, trusted proxies and an API key."""
    return st.builds(trust_of, st.just(mode), st.booleans(),
                     st.sampled_from([[], ["192.0.2.0/24", "::1"]]), st.booleans())


SCOPES = st.fixed_dictionaries({
    "path": st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/x"]),
    "method": st.sampled_from(["POST"] * 8 + ["GET", "PUT"]),
    "client": st.sampled_from([("192.0.2.9", 5555), ("198.51.100.7", 1), ("::1", 2), None]),
})


def through(trust, scope, chunks):
    """Drives the middleware (with `trust`) in front of a recording app once: (what the
    app got, {"body", "headers"}, or None; the response the middleware sent itself,
    (status, body), or None)."""
    seen, sent, pending = {}, [], list(chunks)

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        seen["body"], seen["headers"] = body, list(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return pending.pop(0)

    async def send(message):
        sent.append(message)
    client = scope.get("client")                 # as kvadmit's uvicorn patch records it
    scope = {**scope, PEER_SCOPE_KEY: client[0] if client else None}
    asyncio.run(SloHeaderMiddleware(app, trust)(scope, receive, send))
    if seen:
        return seen, None
    assert len(sent) == 2 and sent[0]["type"] == "http.response.start", sent
    return None, (sent[0]["status"], sent[1]["body"])


def chunked(body: bytes, cuts: list[int]) -> list[dict]:
    points = sorted({min(c, len(body)) for c in cuts})
    parts = [body[a:b] for a, b in zip([0] + points, points + [len(body)])]
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
            for i, p in enumerate(parts)]


def assert_names_a_field(body: bytes):
    error = json.loads(body)["error"]
    param = error["param"]
    assert param in ("priority", "prompt", "sampling_params.extra_args") \
        or param.startswith("vllm_xargs") \
        or param.removeprefix(FLAT_PREFIX).removeprefix(KEY + ".") in FIELD_NAMES, error
    assert param in error["message"], error


def assert_fields_parse_or_are_named(doc: dict):
    """What the adapter does with the body's vllm_xargs (vLLM copies them into
    extra_args as they are, when they pass its own validation)."""
    xargs = doc.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return
    try:
        from_extra_args(xargs, time.time())
    except FieldError as e:
        assert any(k in str(e) for k in xargs), (xargs, str(e))


@pytest.mark.parametrize("mode", MODES)
@given(data=st.data(), scope=SCOPES, headers=HEADER_LISTS, body=BODIES,
       cuts=st.lists(st.integers(0, 200), max_size=2))
def test_the_middleware_passes_a_body_on_or_answers_400_naming_a_field(mode, data, scope, headers,
                                                                        body, cuts):
    trust = data.draw(trusts(mode), "trust")
    check_middleware(trust, {"type": "http", "headers": headers, **scope}, body, cuts)


@pytest.mark.parametrize("trust, headers, body", [
    # nested past the JSON parser's recursion limit
    (trust_of("ignore", True, []), [], b"[" * 100_000),
    # a flow header of 64 KiB digits (past int()'s 4300)
    (trust_of("refuse", False, []), [(b"x-gateway-inference-fairness-id", b"7" * KB64)], b"{}"),
    # an API key's request claiming a flow of 5000 digits
    (trust_of("refuse", True, ["192.0.2.0/24"], api_key=True),
     [(b"x-gateway-inference-fairness-id", b"gold"),
      (b"authorization", b"Bearer " + API_KEY.encode())],
     b'{"priority": -1, "vllm_xargs": {"kvadmit_flow": "' + b"1" * 5000 + b'"}}'),
    # a lone surrogate in vllm_xargs (vLLM answers 500), under ignore: 400 naming it
    (trust_of("ignore", False, []), [], json.dumps({"prompt": [5], "vllm_xargs": {"x": "\ud800"}}).encode()),
], ids=["deep-json", "flow-64k-digits", "api-key-and-long-flow", "lone-surrogate"])
def test_the_middleware_on_the_inputs_fuzzing_found(trust, headers, body):
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "client": ("198.51.100.7", 1), "headers": headers}
    check_middleware(trust, scope, body, [3])


def note(what: str) -> None:
    """Counts what happened among a property's examples (--hypothesis-show-statistics)."""
    if currently_in_test_context():
        event(what)


def check_middleware(trust, scope, body, cuts):
    """The middleware with `trust` on one request: it passes a body on or answers 400
    naming a field (see the module docstring)."""
    headers = scope["headers"]
    seen, answer = through(trust, scope, chunked(body, cuts))
    if answer is not None:
        status, answer_body = answer
        note("answered 400")
        message = json.loads(answer_body)["error"]["message"]
        # untrusted raises are refused in refuse mode; what vLLM would answer with a 500
        # (kvadmit:invalid) or what hides from screening (a vllm_xargs not an object) in
        # any mode that reads the body
        assert status == 400 and trust is not None, answer
        assert trust.mode == "refuse" or message.startswith("kvadmit:invalid") or \
            message.endswith("must be an object"), answer
        assert_names_a_field(answer_body)
        return
    if scope["method"] != "POST":
        note("not a POST: passed on")
        assert seen["body"] == body
        assert [h for h in seen["headers"] if h[0].lower() != SECRET_HEADER] == \
            [h for h in headers if h[0].lower() != SECRET_HEADER]
        return
    assert all(k.lower() != SECRET_HEADER for k, _ in seen["headers"])
    doc = _json_object(body)
    if doc is None:
        note("not a JSON object: passed on")
        assert seen["body"] == body          # not an object: vLLM's to refuse, untouched
        return
    note("passed on " + ("rewritten" if seen["body"] != body else "as it came"))
    if seen["body"] != body:                 # rewritten: a JSON object, its length told
        lengths = [v for k, v in seen["headers"] if k.lower() == b"content-length"]
        assert lengths == [str(len(seen["body"])).encode()], lengths
        doc = json.loads(seen["body"])
        assert isinstance(doc, dict)
    assert_fields_parse_or_are_named(doc)
