"""What a router sees of kvadmit's failed states (patches/vllm_get_load.py), without
vLLM: an engine process writes kvadmit's series into a real Prometheus multiprocess
directory, and the middleware answers `GET /health` and `GET /get_load` from them
(docs/trust-and-failure.md, "What a router sees")."""
import asyncio
import json
import subprocess
import sys

import pytest

from helpers import asgi_answer
from kvadmit_patches.vllm_get_load import FAILED_CLOSED_LOAD, GetLoadMiddleware, kvadmit_signals

ENGINE = """
import sys
from prometheus_client import Counter, Gauge
Gauge("kvadmit_predicted_queue_delay_seconds", "d", multiprocess_mode="livemax").set(0.5)
Gauge("kvadmit_admission_pressure", "p", multiprocess_mode="livemax").set(0.25)
Gauge("kvadmit_waiting_requests", "w", multiprocess_mode="livesum").set(2)
closed = Gauge("kvadmit_failed_closed", "c", multiprocess_mode="livemax")
if sys.argv[1] != "ok":
    Counter("kvadmit_internal_errors", "e").inc()
if sys.argv[1] == "closed":
    closed.set(1)
sys.stdin.read()      # alive until the test has read the files (live* modes)
"""


def call(path, method="GET"):
    """The middleware's answer in front of an app that answers 200 "app": (status,
    headers, body)."""
    return asgi_answer(GetLoadMiddleware, path, method, app_status=200)


@pytest.fixture
def engine(prometheus_multiproc_dir):
    """Starts an engine process in `state` (ok, open, closed) writing into this test's
    multiprocess directory (tests/conftest.py); stopped at the end."""
    procs = []
    path = str(prometheus_multiproc_dir)

    def start(state):
        procs.append(subprocess.Popen([sys.executable, "-c", ENGINE, state],   # inherits it
                                      stdin=subprocess.PIPE, text=True))
        for _ in range(200):
            signals = kvadmit_signals(path)
            if signals and "kvadmit_failed_closed" in signals and (
                    state == "ok" or "kvadmit_internal_errors" in signals):
                return signals
            asyncio.run(asyncio.sleep(0.05))
        raise AssertionError("the engine process wrote no series")

    yield start
    for p in procs:
        p.communicate("")


def test_without_kvadmits_series_health_is_vllms_alone(prometheus_multiproc_dir):
    # no engine wrote into the multiprocess directory
    status, headers, body = call("/health")
    assert (status, body) == (200, b"app") and b"x-kvadmit-state" not in headers


@pytest.mark.parametrize("state, header", [("ok", b"ok"), ("open", b"failed-open")])
def test_health_is_vllms_answer_with_kvadmits_state(engine, state, header):
    engine(state)
    status, headers, body = call("/health")
    assert (status, body) == (200, b"app") and headers[b"x-kvadmit-state"] == header
    assert call("/health", "POST")[0] == 200      # only GET is looked at


def test_failed_closed_health_is_503_and_the_load_keeps_routers_away(engine):
    engine("closed")
    status, headers, body = call("/health")
    assert status == 503 and headers[b"x-kvadmit-state"] == b"failed-closed"
    answer = json.loads(body)
    assert answer["kvadmit"] == "failed-closed" and "restarted" in answer["message"]
    status, _, body = call("/get_load")
    assert status == 200
    assert json.loads(body) == {"load": FAILED_CLOSED_LOAD, "source": "kvadmit",
                                "kvadmit": "failed-closed"}
    assert FAILED_CLOSED_LOAD > 10**12 + 999     # above any load kvadmit reports otherwise
    assert call("/v1/completions", "POST")[2] == b"app"    # the rest passes through
