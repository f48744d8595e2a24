"""kvadmit's failed states where SGLang shows them (kvadmit.sglang.failure, .health,
.metrics; docs/trust-and-failure.md, "kvadmit's failed states"): `/health`,
`/health_generate` and `/v1/loads` of SGLang's real HTTP app
(sglang.srt.entrypoints.http_server.app, with kvadmit's hooks as SGLang loads them,
driven at the ASGI level through httpx), and the Prometheus series.

The state comes from where it is made: a fault injected in kvadmit's adapter on SGLang's
real scheduling classes (tests/sglang/sglang_harness.py) fails it open or closed, and
the HTTP side reads what that failure left; one test has another process (as a
scheduler is) leave it. SGLang's TokenizerManager needs running schedulers over ZMQ,
so the HTTP handlers read a stand-in with the few attributes they use."""
import asyncio
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py
httpx = pytest.importorskip("httpx")
prometheus_client = pytest.importorskip("prometheus_client")

from kvadmit import AdmissionConfig  # noqa: E402
from kvadmit.sglang import failure  # noqa: E402
from kvadmit.sglang.adapter import SGLangAdmission  # noqa: E402
from kvadmit.sglang.health import FailedStateMiddleware  # noqa: E402
from kvadmit.sglang.metrics import PrometheusExport  # noqa: E402
from helpers import fail_on_call  # noqa: E402

LABELS = {"model_name": "m", "engine_type": "unified"}
RUN_ID = "sglang-run-1765000000.5-1234"


def import_http_server():
    """SGLang's HTTP server module. Its import reaches `soundfile` (audio transcription),
    which this environment lacks and nothing here uses: a stub stands in while (and only
    while) the module is first imported, as conftest.py does for torchvision."""
    if "soundfile" in sys.modules or importlib.util.find_spec("soundfile") is not None:
        import sglang.srt.entrypoints.http_server as server
        return server
    stub = types.ModuleType("soundfile")
    stub.__spec__ = importlib.machinery.ModuleSpec("soundfile", None)
    sys.modules["soundfile"] = stub
    try:
        import sglang.srt.entrypoints.http_server as server
    finally:
        if sys.modules.get("soundfile") is stub:
            del sys.modules["soundfile"]
    return server


class TokenizerManagerStandIn:
    """What SGLang's /health, /health_generate, /ready and /v1/loads handlers read of
    its TokenizerManager."""

    gracefully_exit = False
    metrics_collector = None

    def __init__(self, status):
        self.server_status = status

    def is_ready(self):
        return True

    async def get_loads(self, include=None, dp_rank=None):
        from sglang.srt.managers.load_snapshot import LoadSnapshot

        return [LoadSnapshot(dp_rank=0, num_running_reqs=3, num_waiting_reqs=1, token_usage=0.25)]


@pytest.fixture
def sglang_app(kvadmit_hooks, monkeypatch, tmp_path):
    """GET on SGLang's app, as (status, headers, body): `get(path, status=Up)`. Its
    middleware stack is built at the first request, after kvadmit's hooks (as in a
    server, where SGLang loads its plug-ins before it serves); this launch's state
    directory is under tmp_path. /health answers without a generation round
    (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false)."""
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    server = import_http_server()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(failure.RUN_ID_ENV, RUN_ID)
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    monkeypatch.setattr(server.app, "middleware_stack", None)
    monkeypatch.setattr(server, "_global_state", None)

    def get(path, status=ServerStatus.Up):
        server.set_global_state(server._GlobalState(
            tokenizer_manager=TokenizerManagerStandIn(status), template_manager=None,
            scheduler_info={}))

        async def call():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sglang") as c:
                return await c.get(path)
        r = asyncio.run(call())
        assert isinstance(server.app.middleware_stack, FailedStateMiddleware)
        return r.status_code, r.headers, r.content

    get.starting = ServerStatus.Starting
    return get


def fail_a_scheduler(monkeypatch, on_internal_error):
    """kvadmit fails (its step raises, third call) in a scheduler under load: the
    harness and the exporter's registry."""
    from sglang_harness import Harness, make_req

    config = {"policy": "peak", "on_internal_error": on_internal_error}
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps(config))   # the HTTP process has it
    calls = fail_on_call(monkeypatch, SGLangAdmission, "step", 3)
    h = Harness(AdmissionConfig.from_dict(config), pool_tokens=1500)
    registry = prometheus_client.CollectorRegistry()
    h.adapter.exporter = PrometheusExport(LABELS, registry=registry)
    for i in range(12):
        h.submit(make_req(f"r{i}", 60, 300, out_len=40))
    h.run()
    assert len(calls) >= 3 and h.adapter.failed
    return h, registry


def test_without_kvadmit_every_answer_is_sglangs(sglang_app, monkeypatch):
    monkeypatch.delenv("KVADMIT_CONFIG", raising=False)
    failure.write_state(failure.FAILED_CLOSED)        # no configuration: not read
    status, headers, body = sglang_app("/health")
    assert (status, body) == (200, b"") and "x-kvadmit-state" not in headers
    status, headers, body = sglang_app("/v1/loads")
    assert status == 200 and "kvadmit" not in json.loads(body)


def test_running_health_and_loads_are_sglangs_with_the_state(sglang_app, monkeypatch):
    monkeypatch.setenv("KVADMIT_CONFIG", '{"policy": "peak"}')
    status, headers, body = sglang_app("/health")
    assert (status, body, headers["x-kvadmit-state"]) == (200, b"", "ok")
    status, headers, body = sglang_app("/v1/loads?include=core")
    loads = json.loads(body)
    assert status == 200 and headers["x-kvadmit-state"] == "ok"
    assert loads["kvadmit"] == {"state": "ok"} and loads["loads"][0]["token_usage"] == 0.25
    assert int(headers["content-length"]) == len(body)


def test_failed_open_keeps_sglangs_answers_with_the_state(sglang_app, monkeypatch):
    h, registry = fail_a_scheduler(monkeypatch, "open")
    assert not h.outbox.aborts()                       # open: nothing refused
    status, headers, body = sglang_app("/health")
    assert (status, body, headers["x-kvadmit-state"]) == (200, b"", "failed-open")
    # SGLang's own answer stays SGLang's (503 while it starts), with the state
    status, headers, body = sglang_app("/health_generate", status=sglang_app.starting)
    assert (status, body, headers["x-kvadmit-state"]) == (503, b"", "failed-open")
    loads = json.loads(sglang_app("/v1/loads")[2])
    assert loads["kvadmit"] == {"state": "failed-open"} and loads["loads"][0]["token_usage"] == 0.25
    get = registry.get_sample_value
    assert get("kvadmit:internal_errors_total", LABELS) == 1
    assert get("kvadmit:failed_closed", LABELS) == 0


def test_failed_closed_health_is_503_and_loads_say_full(sglang_app, monkeypatch):
    h, registry = fail_a_scheduler(monkeypatch, "closed")
    refused = [o for o in h.outbox.aborts() if o.finished_reason["kvadmit_reason"] == "failed_closed"]
    assert refused
    for path in ("/health", "/health_generate"):
        status, headers, body = sglang_app(path)
        answer = json.loads(body)
        assert status == 503 and headers["x-kvadmit-state"] == "failed-closed", path
        assert answer["kvadmit"] == "failed-closed" and "restarted" in answer["message"]
    status, headers, body = sglang_app("/v1/loads")
    loads = json.loads(body)
    assert status == 200 and headers["x-kvadmit-state"] == "failed-closed"
    assert loads["kvadmit"] == {"state": "failed-closed"} and loads["loads"][0]["token_usage"] == 1.0
    assert loads["loads"][0]["num_running_reqs"] == 3            # the rest is SGLang's
    status, headers, body = sglang_app("/v1/loads?format=prometheus")
    assert status == 200 and b"sglang_token_usage" in body and headers["x-kvadmit-state"]
    status, headers, _ = sglang_app("/ready")                    # other routes: SGLang's
    assert status == 200 and "x-kvadmit-state" not in headers
    get = registry.get_sample_value
    assert get("kvadmit:internal_errors_total", LABELS) == 1
    assert get("kvadmit:failed_closed", LABELS) == 1
    assert get("kvadmit:rejected_total", {**LABELS, "reason": "failed_closed"}) == len(refused)
    # another launch (a restart) has its own directory: nothing stale
    monkeypatch.setenv(failure.RUN_ID_ENV, RUN_ID + "-restarted")
    status, headers, _ = sglang_app("/health")
    assert (status, headers["x-kvadmit-state"]) == (200, "ok")


def test_the_state_another_process_leaves_reaches_the_http_server(sglang_app, monkeypatch,
                                                                   tmp_path):
    """A scheduler is another process: it inherits SGLang's run id and leaves its state
    (failure.write_state, as failure.record does); the HTTP process reads it."""
    monkeypatch.setenv("KVADMIT_CONFIG", '{"on_internal_error": "closed"}')
    assert sglang_app("/health")[0] == 200
    env = dict(os.environ, TMPDIR=str(tmp_path))
    code = ("from kvadmit.sglang.failure import write_state; "
            "print(write_state('failed-closed', 'test'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert os.path.dirname(out) == failure.state_dir()
    assert os.path.basename(out).startswith("failed-closed.")
    status, headers, _ = sglang_app("/health")
    assert status == 503 and headers["x-kvadmit-state"] == "failed-closed"


def test_only_sglangs_app_gets_the_middleware(kvadmit_hooks):
    from fastapi import FastAPI

    assert not isinstance(FastAPI().build_middleware_stack(), FailedStateMiddleware)
