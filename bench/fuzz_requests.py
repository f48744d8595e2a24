"""The requests of bench/fuzz_serve.py (bad input, fuzzed; issue 53): request i of a
run is made by its own seeded generator (`make_request`), so a run is the same every
time and any one request can be made again from its index. They mirror the hypothesis
strategies of tests/test_fuzz_fields.py: junk JSON values (wrong types, huge numbers,
NaN and infinities written as the JSON tokens, unicode, 64 KiB strings), kvadmit's
fields in vllm_xargs (valid or junk), priority, max_tokens and prompts (valid or junk),
the gateway headers (valid or junk), the gateway secret (right or wrong), forwarding
headers with junk, latin-1 and 64 KiB header values, repeated headers, and a few bodies
that are not JSON."""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field

from kvadmit.request_fields import FLAT_PREFIX, HEADERS, KEY, SCHEMA
from kvadmit.trust import SECRET_HEADER

SECRET = "fuzz-gateway-secret"      # the servers' KVADMIT_GATEWAY_SECRET
PROXY = "127.0.0.2"                 # their trusted_proxies; a quarter of the requests come from it
VOCAB = 1024                        # kvadmit.vllm.tiny_model's vocab_size
KB64 = 64 * 1024
# How much of a request is junk: each value junk with this probability (a third of the
# requests each); 0 is a well-formed request (its fields may still be refused: a
# deadline past, a flow over its cap).
JUNK_LEVELS = (0.0, 0.2, 0.6)
FIELD_NAMES = [f.name for f in SCHEMA]


@dataclass
class Request:
    index: int
    route: str
    stream: bool
    source: str                                  # the client's address
    headers: list = field(default_factory=list)  # [(name, value)] as bytes, repeats kept
    body: bytes = b""

    def record(self, limit: int = 2048) -> dict:
        """The request as saved: long bodies and header values cut (their length kept)."""
        def cut(b: bytes):
            text = b.decode("latin-1")
            return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} bytes)"
        return {"index": self.index, "route": self.route, "stream": self.stream,
                "source": self.source, "headers": [[cut(k), cut(v)] for k, v in self.headers],
                "body": cut(self.body)}


HUGE = [2**62, 2**62 + 1, 2**63, -2**63, 2**64, 10**30, 10**400, -10**400, 10**4299]
SPECIAL_FLOATS = [math.nan, math.nan, math.nan, math.inf, -math.inf, 1e308, -0.0, 1e-300, 1e400]
NUMERIC_TEXT = ["1", "7", "0", "-1", "1e400", "nan", "NaN", "inf", "-inf", "1_000", " 7 ",
                "0x10", "true", "false", "1500ms", "30s", "2m", "1h", "", " ", "\u0663",
                "\uff17", "7\u200b", "\u00e9\u4e2d\U0001f600", "\ud800"]


def junk_value(rng: random.Random, depth: int = 0):
    """Any JSON value a client may send: wrong types, huge numbers, NaN and infinities,
    unicode, 64 KiB strings, lists and objects."""
    kind = rng.randrange(10 if depth < 2 else 8)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice(HUGE) if rng.random() < 0.5 else rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.choice(SPECIAL_FLOATS) if rng.random() < 0.6 else rng.uniform(-1e6, 1e6)
    if kind in (3, 4):
        return rng.choice(NUMERIC_TEXT)
    if kind == 5:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(160, 0x3000),
                                       rng.randrange(0x1F300, 0x1F650)]))
                       for _ in range(rng.randrange(0, 24)))
    if kind == 6:
        return rng.choice("7a\u00e9\u4e2d") * rng.choice([KB64, 5000, 19, 20])
    if kind == 7:
        return rng.uniform(0, 5)
    if kind == 8:
        return [junk_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "kvadmit", "ttft_slo_s", "flow", "\u00e9"]): junk_value(rng, depth + 1)
            for _ in range(rng.randrange(3))}


def valid_value(rng: random.Random, name: str):
    """A value kvadmit takes for field `name` (as vllm_xargs carries it)."""
    return {
        "ttft_slo_s": lambda: rng.choice([0, 0.5, 2.0, 30]),
        "tpot_slo_s": lambda: rng.choice([0, 0.05, 1.0]),
        "session": lambda: rng.choice(["agent-1", "s\u00e9", 3, "3"]),
        "deadline_s": lambda: time.time() + rng.choice([-5, 0.5, 30, 600]),
        "ttl_s": lambda: rng.choice([0, 1, 30, 120]),
        "flow": lambda: rng.choice(["gold", "7", "tenant-\u4e2d", 7, 12345]),
        "sheddable": lambda: rng.choice([True, False, "true", "0", 1]),
        "max_queue_delay_s": lambda: rng.choice([0, 0.5, 10]),
        "kv_hold_s": lambda: rng.choice([0, 5, 60]),
    }[name]()


def xargs(rng: random.Random, junk: float):
    """vllm_xargs: kvadmit's flat fields (each junk with probability `junk`), and with
    `junk` the object form, vLLM's session_id, other keys, or not an object at all."""
    if rng.random() < junk * 0.1:
        return junk_value(rng)
    out = {}
    for _ in range(rng.randrange(1, 5)):
        r = rng.random()
        if r >= junk * 0.4:
            name = rng.choice(FIELD_NAMES)
            value = junk_value(rng) if rng.random() < junk else valid_value(rng, name)
            out[FLAT_PREFIX + name] = value
        elif r < junk * 0.2:
            key = rng.choice([KEY, "session_id", "kvadmit_untrusted", "kvadmit_nope"])
            out[key] = junk_value(rng)
        else:
            out[rng.choice(["x", "\u00e9\u4e2d", "kvadmit_" + "z" * 300])] = junk_value(rng)
    return out


def prompt(rng: random.Random, i: int, junk: float):
    """Token ids inside the vocabulary, or (with probability `junk` / 2) a junk prompt."""
    ids = [(i * 7919 + k) % (VOCAB - 8) + 4 for k in range(rng.randrange(1, 33))]
    if rng.random() >= junk / 2:
        return ids
    return rng.choice([
        lambda: ids + [rng.choice([VOCAB, VOCAB + 1, 2**31, 2**63, 10**30, -1, -2**63])],
        lambda: ids + [rng.choice([1.5, math.nan, "w10", None, True])],
        lambda: [], lambda: [ids, ids[:3]], lambda: "w10 w11 \u00e9\u4e2d",
        lambda: junk_value(rng), lambda: "w12 " * rng.choice([4, 600]),
    ])()


def messages(rng: random.Random, junk: float):
    content = " ".join(f"w{rng.randrange(4, VOCAB)}" for _ in range(rng.randrange(1, 16)))
    if rng.random() >= junk / 2:
        return [{"role": "user", "content": content}]
    return rng.choice([
        lambda: [{"role": "user", "content": junk_value(rng)}],
        lambda: [{"role": junk_value(rng), "content": content}],
        lambda: [], lambda: junk_value(rng),
        lambda: [{"role": "user", "content": "\u00e9\u4e2d\U0001f600 " * 10}],
    ])()


def body_doc(rng: random.Random, i: int, route: str, stream: bool, model: str,
             junk: float) -> dict:
    doc = {"model": model, "max_tokens": rng.randint(1, 6), "stream": stream,
           "ignore_eos": rng.random() < 0.5}
    if route.endswith("chat/completions"):
        doc["messages"] = messages(rng, junk)
    else:
        doc["prompt"] = prompt(rng, i, junk)
    if rng.random() < junk * 0.2:
        doc["max_tokens"] = rng.choice([0, -1, "4", None, True, 2**62 + 1, 10**30]
                                       + SPECIAL_FLOATS)
    if rng.random() < 0.1:
        doc.update(n=2, temperature=0.7)
    if rng.random() < 0.5:
        doc["priority"] = junk_value(rng) if rng.random() < junk else rng.randint(-3, 3)
    if rng.random() < 0.7:
        doc["vllm_xargs"] = xargs(rng, junk)
    if rng.random() < junk * 0.2:
        doc[rng.choice(["session_id", KEY, "\u00e9"])] = junk_value(rng)
    return doc


def header_value(rng: random.Random, name: bytes, junk: float) -> bytes:
    """A value for header `name`: a valid one for the gateway's and the secret, or (with
    probability `junk`, always for the others) junk: numeric text, latin-1 bytes,
    addresses, 64 KiB."""
    field_ = HEADERS.get(name)
    if field_ is not None and rng.random() >= junk:
        return rng.choice({"ms": [b"250", b"40", b"0"], "duration": [b"30s", b"1500ms", b"2"],
                           "text": [b"gold", b"7", b"tenant-b", b"true"]}[field_.header_unit])
    if name == SECRET_HEADER and rng.random() >= junk:
        return SECRET.encode()
    r = rng.random()
    if r < 0.4:
        return rng.choice(NUMERIC_TEXT + ["guess"]).encode("utf-8", "surrogatepass")
    if r < 0.6:
        return bytes(rng.choice([rng.randrange(0x21, 0x7F), rng.randrange(0x80, 0x100)])
                     for _ in range(rng.randrange(1, 30)))
    if r < 0.9:
        return rng.choice([b"127.0.0.2", b"for=127.0.0.2;proto=https", b"10.0.0.1, 127.0.0.2",
                           b"::1", b"[::1]:80", b"for=\"_hidden\"", b"unknown", b"gold"])
    return rng.choice([b"7", b"a", b"\xe9"]) * rng.choice([KB64, 16 * 1024, 8 * 1024])


def headers(rng: random.Random, junk: float) -> list:
    names = [*HEADERS, SECRET_HEADER, b"x-forwarded-for", b"forwarded", b"x-real-ip",
             b"x-session-id", b"x-junk"]
    out = [(b"content-type", b"application/json")]
    for name in names:
        if rng.random() < 0.25:
            value = header_value(rng, name, junk)
            if rng.random() < 0.3:
                name = name.upper()
            # h11 (httpx's HTTP/1.1) sends no value with whitespace at either end
            out.append((name, value.strip(b" \t")))
    if len(out) > 1 and rng.random() < 0.2:
        out.append(rng.choice(out[1:]))                   # a repeated header
    return out


JUNK_BODIES = [b"", b"{", b"null", b"[]", b"not json", b'{"prompt": [5], "vllm_xargs": NaN}',
               b"[" * 100_000, b'{"prompt": [5], "priority": ' + b"9" * 5000 + b"}",
               b'{"prompt": "\xff\xfe", "max_tokens": 2}', b'\xef\xbb\xbf{"prompt": [5]}']


def make_request(seed: int, i: int, routes, model: str) -> Request:
    """Request i of the run with `seed` to a server of `model`: the same request every
    time."""
    rng = random.Random(seed * 1_000_003 + i)
    route, stream = rng.choice(routes), rng.random() < 0.5
    junk = rng.choice(JUNK_LEVELS)
    if rng.random() < junk * 0.06:
        body = rng.choice(JUNK_BODIES)
    else:   # NaN and the infinities as the JSON tokens NaN, Infinity
        body = json.dumps(body_doc(rng, i, route, stream, model, junk)).encode()
    return Request(i, route, stream, PROXY if rng.random() < 0.25 else "127.0.0.1",
                   headers(rng, junk), body)
