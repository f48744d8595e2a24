"""GIE's x-slo-* request headers as kvadmit's flat vllm_xargs fields
(patches/vllm_slo_headers.py), on the ASGI level with a recording app."""
import asyncio
import json

import pytest

from kvadmit.request_fields import FieldError, flow_int, from_extra_args, session_int
from kvadmit_patches.vllm_slo_headers import SloHeaderMiddleware, slo_fields, with_fields


def test_headers_become_seconds_and_the_body_wins():
    fields = slo_fields([(b"X-SLO-TTFT-MS", b"250"), (b"x-slo-tpot-ms", b" 40 "), (b"other", b"1")])
    assert fields == {"kvadmit_ttft_slo_s": 0.25, "kvadmit_tpot_slo_s": 0.04}
    body = with_fields(json.dumps({"prompt": "x", "vllm_xargs": {"kvadmit_ttft_slo_s": 9}}).encode(),
                       fields)
    assert json.loads(body)["vllm_xargs"] == {"kvadmit_ttft_slo_s": 9, "kvadmit_tpot_slo_s": 0.04}
    assert slo_fields([(b"x-slo-ttft-ms", b"soon")]) == {"kvadmit_ttft_slo_s": "soon"}
    assert with_fields(b"[1, 2]", fields) is None and with_fields(b"{bad", fields) is None


def test_the_ttl_header_is_seconds_or_a_duration():
    def ttl(v):
        return slo_fields([(b"X-LLM-D-Inference-TTL", v)])["kvadmit_ttl_s"]
    assert (ttl(b"30"), ttl(b"30s"), ttl(b"1500ms"), ttl(b"2m"), ttl(b"1h")) == \
        (30.0, 30.0, 1.5, 120.0, 3600.0)
    assert ttl(b"soon") == "soon"             # passed on: kvadmit refuses it, naming ttl_s


def test_the_fairness_header_is_the_flow_field():
    def flow(v):
        return slo_fields([(b"X-Gateway-Inference-Fairness-Id", v)])["kvadmit_flow"]
    assert (flow(b"tenant-a"), flow(b" 7 ")) == ("tenant-a", "7")
    fields = from_extra_args(slo_fields([(b"x-gateway-inference-fairness-id", b"tenant-a")]))
    assert fields.flow == flow_int("tenant-a") == session_int("tenant-a")
    assert from_extra_args(slo_fields([(b"x-gateway-inference-fairness-id", b"7")])).flow == 7
    with pytest.raises(FieldError, match="flow=''"):     # an empty header: refused as invalid
        from_extra_args(slo_fields([(b"x-gateway-inference-fairness-id", b"")]))


def run(scope, chunks):
    seen = {}

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            m = await receive()
            body += m.get("body", b"")
            more = m.get("more_body", False)
        seen["body"], seen["headers"] = body, dict(scope["headers"])

    async def receive():
        return chunks.pop(0)

    async def send(message):
        pass
    asyncio.run(SloHeaderMiddleware(app)(scope, receive, send))
    return seen


def test_a_completion_body_in_two_chunks_gets_the_fields_and_its_length():
    doc = json.dumps({"model": "m", "prompt": [5, 6]}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-length", str(len(doc)).encode()), (b"x-slo-ttft-ms", b"500")]}
    seen = run(scope, [{"type": "http.request", "body": doc[:7], "more_body": True},
                       {"type": "http.request", "body": doc[7:], "more_body": False}])
    assert json.loads(seen["body"])["vllm_xargs"] == {"kvadmit_ttft_slo_s": 0.5}
    assert seen["headers"][b"content-length"] == str(len(seen["body"])).encode()


def test_other_requests_pass_untouched():
    doc = b'{"prompt": "x"}'
    for path, headers in (("/v1/completions", []), ("/health", [(b"x-slo-ttft-ms", b"5")])):
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        seen = run(scope, [{"type": "http.request", "body": doc, "more_body": False}])
        assert seen["body"] == doc, path


def test_the_sheddable_header_is_the_sheddable_field():
    def sheddable(v):
        return from_extra_args(slo_fields([(b"X-Kvadmit-Sheddable", v)])).sheddable
    assert (sheddable(b"true"), sheddable(b" 1 "), sheddable(b"false")) == (True, True, False)
    with pytest.raises(FieldError, match="kvadmit_sheddable='maybe': must be true or false"):
        sheddable(b"maybe")
