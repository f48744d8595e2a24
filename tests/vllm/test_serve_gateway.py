"""The trust boundary on `vllm serve` (kvadmit.trust, patches/vllm_slo_headers.py,
kvadmit_patches.asgi_socket_peer), behind a real HAProxy run from the recipe in
docs/trust-and-failure.md, with vLLM's own `--api-key` (three keys).

The server lists the gateway's address (127.0.0.2: HAProxy connects from it) in
`trusted_proxies`; flow "gold" is capped at one waiting request; flow "bronze" is bound
to its tenant's API key. A burst claiming gold is gold's (its cap refuses part of it)
only when the gateway says so; a client that connects directly from 127.0.0.1 (which
uvicorn trusts to set X-Forwarded-For) and claims the gateway's address in
X-Forwarded-For, Forwarded or X-Real-IP gains nothing, and nor does a caller's body
claim through the gateway (which vouches for its headers only); bronze's key is
bronze's, through the gateway or not, whatever flow its headers or body claim."""
import asyncio
import pathlib
import re
import shutil
import subprocess
import time
import urllib.request

import httpx
import pytest
from serving import free_port, metrics, running_server, serve_command

from kvadmit.flow_settings import key_digest

if shutil.which("haproxy") is None:
    pytest.skip("haproxy is not installed (.ci/run installs Debian's package)",
                allow_module_level=True)

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "trust-and-failure.md"
GOLD_KEY, BRONZE_KEY, PLAIN_KEY = "key-of-the-gold-tenant", "key-of-bronze", "key-plain"
CONFIG = {"kvadmit": {"flows": {"gold": {"max_queued_requests": 1},
                                "bronze": {"api_keys": [key_digest(BRONZE_KEY)]}},
                      "trusted_proxies": ["127.0.0.2"]}}
BURST = 10
FORGED = {"x-forwarded-for": "127.0.0.2", "forwarded": "for=127.0.0.2", "x-real-ip": "127.0.0.2"}


def recipe(name: str) -> str:
    """The fenced block after `<!-- recipe: NAME -->` in docs/trust-and-failure.md."""
    match = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/trust-and-failure.md has no recipe {name}"
    return match.group(1)


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    """(vLLM's URL, the gateway's URL, the model)."""
    workdir = tmp_path_factory.mktemp("gateway")
    vllm_port, gateway_port = free_port(), free_port()
    cmd = serve_command(model_dir, vllm_port, CONFIG,
                        extra=("--api-key", GOLD_KEY, BRONZE_KEY, PLAIN_KEY))
    tenants = workdir / "tenants.map"
    tenants.write_text(recipe("tenants.map"))
    cfg = workdir / "haproxy.cfg"
    text = recipe("haproxy.cfg")
    for name, value in (("gateway_port", gateway_port), ("vllm_port", vllm_port),
                        ("tenants_map", tenants)):
        text = text.replace("{" + name + "}", str(value))
    cfg.write_text(text)
    with running_server(cmd, workdir / "serve.log") as base:
        with open(workdir / "haproxy.log", "w") as log:
            proxy = subprocess.Popen([shutil.which("haproxy"), "-db", "-f", str(cfg)],
                                     stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{gateway_port}"
        try:
            for _ in range(50):
                try:
                    urllib.request.urlopen(url + "/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.2)
            yield base, url, model_dir
        finally:
            proxy.terminate()
            proxy.wait(10)


def burst(url, model, key, headers=(), xargs=None):
    async def one(client, i):
        body = {"model": model, "prompt": [(i * 7919 + k) % 997 + 3 for k in range(60)],
                "max_tokens": 32, "ignore_eos": True}
        if xargs:
            body["vllm_xargs"] = xargs
        r = await client.post(url + "/v1/completions", json=body,
                              headers={"authorization": f"Bearer {key}", **dict(headers)})
        return r.status_code, r.json()

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(BURST)))
    return asyncio.run(run())


def counted(base, field="kvadmit_flow"):
    return metrics(base).get(f'kvadmit_untrusted_fields_total{{field="{field}"}}', 0.0)


def capped_by_gold(answers) -> bool:
    statuses = [s for s, _ in answers]
    refused = [a["error"]["message"] for s, a in answers if s == 429]
    return (set(statuses) == {200, 429} and len(refused) >= 3
            and all(m.startswith("kvadmit:queue_full:") and "flow 'gold'" in m for m in refused))


@pytest.mark.parametrize("forged", [("x-forwarded-for",), ("forwarded",), ("x-real-ip",),
                                    tuple(FORGED)])
def test_a_direct_client_that_forges_the_gateways_address_gains_nothing(gateway, forged):
    base, _, model = gateway
    before = counted(base)
    headers = {"x-gateway-inference-fairness-id": "gold", **{h: FORGED[h] for h in forged}}
    answers = burst(base, model, PLAIN_KEY, headers)
    assert [s for s, _ in answers] == [200] * BURST, answers
    assert counted(base) == before + BURST


def test_the_gateways_tenant_is_honoured_and_its_cap_refuses(gateway):
    base, url, model = gateway
    before = counted(base)
    # the gateway sets gold from the caller's key, whatever the caller sent
    answers = burst(url, model, GOLD_KEY, {"x-gateway-inference-fairness-id": "bronze",
                                           **FORGED})
    assert capped_by_gold(answers), answers
    # a caller whose key the gateway does not map cannot name a tenant through it
    answers = burst(url, model, PLAIN_KEY, {"x-gateway-inference-fairness-id": "gold"})
    assert [s for s, _ in answers] == [200] * BURST, answers
    assert counted(base) == before


def test_a_callers_body_claim_through_the_gateway_is_screened(gateway):
    """The gateway vouches for the headers it sets, not for the body it forwards."""
    base, url, model = gateway
    before = counted(base)
    answers = burst(url, model, PLAIN_KEY, xargs={"kvadmit_flow": "gold"})
    assert [s for s, _ in answers] == [200] * BURST, answers       # gold's cap: not applied
    assert counted(base) == before + BURST


@pytest.mark.parametrize("through_gateway", [False, True])
def test_a_tenants_key_cannot_be_charged_to_another_flow(gateway, through_gateway):
    """Bronze's key claiming gold in the header (the gateway drops it) and in the body:
    bronze's (no cap: all served), each claim counted. (vLLM itself refuses the nested
    object form of vllm_xargs, {"kvadmit": {...}}, with 400.)"""
    base, url, model = gateway
    before = counted(base)
    answers = burst(url if through_gateway else base, model, BRONZE_KEY,
                    {"x-gateway-inference-fairness-id": "gold"},
                    {"kvadmit_flow": "gold"})
    assert [s for s, _ in answers] == [200] * BURST, answers
    assert counted(base) == before + BURST
    m = metrics(base)
    assert m["kvadmit_waiting_requests"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
