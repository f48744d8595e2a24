"""`GET /get_load` (patches/vllm_get_load.py) without vLLM: the load key's order, the
signals read back from a real Prometheus multiprocess directory, the ASGI answer."""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from kvadmit_patches.vllm_get_load import GetLoadMiddleware, kvadmit_signals, load_report


@pytest.mark.parametrize("less, more", [
    ((0.0, 0.2, 0), (0.0, 0.9, 0)),        # nothing waits: the one with more room
    ((0.0, 0.99, 0), (0.004, 0.1, 1)),     # any wait outweighs any pressure
    ((1.5, 2.0, 9), (2.5, 0.0, 3)),        # both queue: the shorter predicted wait
])
def test_a_router_comparing_two_loads_picks_the_shorter_wait(less, more):
    a, b = load_report(*less), load_report(*more)
    assert a["load"] < b["load"], (a, b)


def test_the_report_names_its_parts():
    r = load_report(1.2345, 1.7, 4)
    assert r == {"load": 1235 * 1000 + 999, "predicted_wait_ms": 1235,
                 "admission_pressure_permille": 999, "waiting": 4, "source": "kvadmit"}
    assert load_report(float("inf"), float("nan"), 0)["predicted_wait_ms"] == 10**9


WRITER = """
import os, sys
from prometheus_client import Gauge
Gauge("kvadmit_predicted_queue_delay_seconds", "d", multiprocess_mode="livemax").set(float(sys.argv[1]))
Gauge("kvadmit_admission_pressure", "p", multiprocess_mode="livemax").set(float(sys.argv[2]))
Gauge("kvadmit_waiting_requests", "w", multiprocess_mode="livesum").set(float(sys.argv[3]))
sys.stdin.read()      # alive until the test has read the files (live* modes)
"""


def test_signals_come_from_the_engine_processes_series(tmp_path):
    """Two engine processes (data-parallel ranks) write their gauges: the report takes
    the larger wait and pressure and the sum of waiting requests."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, *args], env=env,
                              stdin=subprocess.PIPE, text=True)
             for args in (("0.5", "0.25", "2"), ("1.5", "0.75", "3"))]
    try:
        for _ in range(100):
            signals = kvadmit_signals(str(tmp_path))
            if signals and signals.get("kvadmit_waiting_requests") == 5:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert signals == {"kvadmit_predicted_queue_delay_seconds": 1.5,
                           "kvadmit_admission_pressure": 0.75,
                           "kvadmit_waiting_requests": 5.0}, signals
    finally:
        for p in procs:
            p.communicate("")
    (tmp_path / "none").mkdir()
    assert kvadmit_signals(str(tmp_path / "none")) is None     # no engine wrote: no signals


def call(path, method="GET"):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})

    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(GetLoadMiddleware(app)({"type": "http", "path": path, "method": method},
                                       None, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_middleware_answers_get_load_and_passes_the_rest(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))   # no engine wrote: vLLM's count
    status, body = call("/get_load")
    assert status == 200 and json.loads(body) == {"load": 0, "source": "vllm"}
    assert call("/get_load", "POST") == (404, b"app")
    assert call("/v1/completions") == (404, b"app")


def test_once_kvadmit_failed_open_the_report_is_vllms_and_says_so(monkeypatch, tmp_path):
    """An engine process where kvadmit failed open (its metrics' internal-error count
    above 0): kvadmit's gauges stand still, so /get_load answers vLLM's own count and
    names the state."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    writer = WRITER.replace("sys.stdin.read()", "from prometheus_client import Counter\n"
                            "Counter('kvadmit_internal_errors', 'e').inc()\nsys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", writer, "0.5", "0.25", "2"], env=env,
                            stdin=subprocess.PIPE, text=True)
    try:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        for _ in range(100):
            signals = kvadmit_signals(str(tmp_path))
            if signals and signals.get("kvadmit_internal_errors") == 1:
                break
            asyncio.run(asyncio.sleep(0.05))
        status, body = call("/get_load")
        assert status == 200
        assert json.loads(body) == {"load": 0, "source": "vllm", "kvadmit": "failed-open"}
    finally:
        proc.communicate("")
