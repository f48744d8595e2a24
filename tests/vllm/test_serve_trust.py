"""Who may raise a request's claim, on `vllm serve` (kvadmit.trust,
patches/vllm_slo_headers.py): a server with one flow, "gold", whose queue is capped at
one waiting request, and a gateway secret in its environment.

From a client without the secret, the flow header and a priority above the default
are ignored and counted: a burst claiming gold is all served (gold's cap never
applies, and vLLM's own check, which refuses a priority other than 0 without priority
scheduling, never sees one). The same burst from the gateway, with the secret, is
gold's: its cap refuses what does not fit, as kvadmit's queue_full naming the flow.""" 
import asyncio

import httpx
import pytest
from serving import free_port, metrics, running_server, serve_command

SECRET = "s3cret-for-the-test"
CONFIG = {"kvadmit": {"flows": {"gold": {"max_queued_requests": 1}}}}
BURST = 10


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    cmd = serve_command(model_dir, free_port(), CONFIG)
    with running_server(cmd, log, env={"KVADMIT_GATEWAY_SECRET": SECRET}) as base:
        yield base, model_dir


def burst(base, model, headers, priority=0):
    async def one(client, i):
        r = await client.post(base + "/v1/completions", headers=headers, json={
            "model": model, "prompt": [(i * 7919 + k) % 997 + 3 for k in range(60)],
            "max_tokens": 32, "ignore_eos": True, "priority": priority})
        return r.status_code, r.json()

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(BURST)))
    return asyncio.run(run())


def counted(base, field):
    return metrics(base).get(f'kvadmit_untrusted_fields_total{{field="{field}"}}', 0.0)


def test_an_untrusted_claim_is_ignored_and_counted_and_the_gateways_is_honoured(server):
    base, model = server
    flow0, priority0 = counted(base, "kvadmit_flow"), counted(base, "priority")
    answers = burst(base, model, {"x-gateway-inference-fairness-id": "gold"}, priority=-2)
    assert [s for s, _ in answers] == [200] * BURST, answers
    assert all(len(a["choices"][0]["text"]) >= 0 and a["usage"]["completion_tokens"] == 32
               for _, a in answers)
    assert counted(base, "kvadmit_flow") == flow0 + BURST
    assert counted(base, "priority") == priority0 + BURST

    answers = burst(base, model, {"x-gateway-inference-fairness-id": "gold",
                                  "x-kvadmit-gateway-secret": SECRET})
    statuses = [s for s, _ in answers]
    assert statuses.count(200) >= 1 and statuses.count(429) >= 3, answers   # 429: the default
    assert set(statuses) == {200, 429}
    for status, a in answers:
        if status == 429:       # gold's own cap
            message = a["error"]["message"]
            assert message.startswith("kvadmit:queue_full:") and "flow 'gold'" in message, a
    assert counted(base, "kvadmit_flow") == flow0 + BURST     # nothing counted from the gateway
    m = metrics(base)
    assert m["kvadmit_waiting_requests"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
