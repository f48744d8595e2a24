"""`GET /get_load` (patches/vllm_get_load.py) without vLLM: the load key's order, the
signals read back from a real Prometheus multiprocess directory, the ASGI answer."""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from helpers import asgi_answer
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


def call(path, method="GET", query=b""):
    status, _, body = asgi_answer(GetLoadMiddleware, path, method, query)
    return status, body


def test_the_middleware_answers_get_load_and_passes_the_rest(prometheus_multiproc_dir):
    # no engine wrote into the multiprocess directory: vLLM's count
    status, body = call("/get_load")
    assert status == 200 and json.loads(body) == {"load": 0, "source": "vllm"}
    assert call("/get_load", "POST") == (404, b"app")
    assert call("/v1/completions") == (404, b"app")


def test_once_kvadmit_failed_open_the_report_is_vllms_and_says_so(prometheus_multiproc_dir):
    """An engine process where kvadmit failed open (its metrics' internal-error count
    above 0): kvadmit's gauges stand still, so /get_load answers vLLM's own count and
    names the state."""
    writer = WRITER.replace("sys.stdin.read()", "from prometheus_client import Counter\n"
                            "Counter('kvadmit_internal_errors', 'e').inc()\nsys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", writer, "0.5", "0.25", "2"],  # inherits the dir
                            stdin=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            signals = kvadmit_signals(str(prometheus_multiproc_dir))
            if signals and signals.get("kvadmit_internal_errors") == 1:
                break
            asyncio.run(asyncio.sleep(0.05))
        status, body = call("/get_load")
        assert status == 200
        assert json.loads(body) == {"load": 0, "source": "vllm", "kvadmit": "failed-open"}
    finally:
        proc.communicate("")


# --- GET /v1/loads: SMG 1.13's load probe (SGLang's schema) ---------------------------

from kvadmit_patches.vllm_get_load import (  # noqa: E402
    SMG_DEFAULT_THROUGHPUT, GenerationRate, v1_loads_report)

# SMG's SchedulerLoadSnapshot (openai_protocol::worker, crates/protocols/src/worker.rs in
# github.com/smg-project/smg): its integer fields are i32, so a JSON float there fails
# SMG's parse and it memoizes the worker as having no /v1/loads.
SMG_INT = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
           "num_total_reqs", "num_used_tokens", "max_total_num_tokens", "max_running_requests",
           "prefill_queue_reqs", "decode_queue_reqs"}
SMG_FLOAT = {"token_usage", "gen_throughput", "cache_hit_rate", "utilization",
             "kv_transfer_latency_ms", "kv_transfer_speed_gb_s"}
SMG_OBJECT = {"memory", "queues"}
VLLM_IDLE = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
             "vllm:kv_cache_usage_perc": 0.0}


def kvadmit(delay, pressure, waiting):
    return {"kvadmit_predicted_queue_delay_seconds": delay,
            "kvadmit_admission_pressure": pressure, "kvadmit_waiting_requests": waiting}


def smg_expected_wait(report, default_throughput=SMG_DEFAULT_THROUGHPUT, mean_prefill=1024,
                      kv_weight=0.15):
    """SMG 1.13's power_of_two / least_load score of a worker from its last poll
    (LeastLoadPolicy::score, model_gateway/src/policies/least_load.rs, with nothing
    dispatched since the poll): queued tokens / throughput + 0.15 k / (1 - k)."""
    loads = report["loads"]
    queued = sum(r.get("num_waiting_uncached_tokens", 0) for r in loads)
    if queued <= 0:
        queued = sum(r.get("num_waiting_reqs", 0) for r in loads) * mean_prefill
    rate = sum(r.get("gen_throughput", 0.0) for r in loads) or default_throughput
    k = min(0.999, max(0.0, sum(r.get("token_usage", 0.0) for r in loads) / len(loads)))
    return queued / rate + kv_weight * k / (1 - k)


def assert_smg_schema(report):
    assert isinstance(report["timestamp"], str) and isinstance(report["version"], str)
    assert report["dp_rank_count"] == len(report["loads"]) == 1
    for rank in report["loads"]:
        assert set(rank) <= SMG_INT | SMG_FLOAT | SMG_OBJECT, set(rank) - SMG_INT - SMG_FLOAT
        for key, value in rank.items():
            want = int if key in SMG_INT else float if key in SMG_FLOAT else dict
            assert type(value) is want or (want is float and type(value) is int), (key, value)
        assert 0.0 <= rank["token_usage"] <= 1.0


@pytest.mark.parametrize("rate", [0.0, 37.5, 4000.0])
@pytest.mark.parametrize("delay", [0.0, 0.25, 3.2])
def test_smgs_expected_wait_term_is_kvadmits_predicted_delay(delay, rate):
    """Whatever the measured generation rate (none: SMG's default), the queue term SMG
    computes from the report is kvadmit's predicted delay, to the rounding of a token."""
    waiting = 3 if delay else 0
    report = v1_loads_report(VLLM_IDLE, kvadmit(delay, 0.0, waiting), {"core"}, rate)
    assert_smg_schema(report)
    rank = report["loads"][0]
    assert rank["num_waiting_reqs"] == waiting and rank["token_usage"] == 0.0
    divisor = rate or SMG_DEFAULT_THROUGHPUT
    assert delay <= smg_expected_wait(report) <= delay + 1.0 / divisor + 1e-9
    assert report["kvadmit"] == {"source": "kvadmit", "predicted_queue_delay_s": delay,
                                 "admission_pressure": 0.0}


def test_requests_waiting_with_no_predicted_wait_get_smgs_own_estimate():
    """kvadmit predicts no wait (nothing to wait for, or no admission rate measured
    yet) while requests wait: no queued tokens, so SMG estimates the queue from the
    waiting count, as for any backend that reports none (1024 tokens each)."""
    report = v1_loads_report(VLLM_IDLE, kvadmit(0.0, 0.0, 3), {"core"}, 100.0)
    assert report["loads"][0]["num_waiting_uncached_tokens"] == 0
    assert smg_expected_wait(report) == pytest.approx(3 * 1024 / 100.0)


@pytest.mark.parametrize("less, more", [
    ((0.0, 0.2, 0), (0.0, 0.7, 0)),        # nothing waits: the one with more room
    ((0.0, 0.5, 0), (0.3, 0.1, 1)),        # a wait outweighs moderate pressure
    ((1.5, 0.5, 9), (2.5, 0.0, 3)),        # both queue: the shorter predicted wait
    ((2.5, 0.0, 3), (1.5, 0.9, 9)),        # ... unless SMG's KV barrier, 0.15 p / (1 - p), adds more
])
def test_smg_scoring_kvadmits_reports_prefers_the_shorter_wait(less, more):
    a = v1_loads_report(VLLM_IDLE, kvadmit(*less), {"core"}, 100.0)
    b = v1_loads_report(VLLM_IDLE, kvadmit(*more), {"core"}, 100.0)
    assert smg_expected_wait(a) < smg_expected_wait(b), (a, b)


def test_pressure_is_smgs_token_usage_capped_at_one():
    """SMG's overload check leaves out a worker whose token_usage reaches its threshold
    (0.8 by default): with kvadmit that is the forecast KV demand, not what is in use."""
    for pressure, usage in ((0.8123456, 0.8123), (1.7, 1.0), (-0.1, 0.0), (float("nan"), 1.0)):
        rank = v1_loads_report(VLLM_IDLE, kvadmit(0.0, pressure, 0), set(), 0.0)["loads"][0]
        assert rank["token_usage"] == usage, (pressure, rank)
    rank = v1_loads_report(VLLM_IDLE, kvadmit(float("inf"), 1.0, 5), set(), 10.0)["loads"][0]
    assert rank["num_waiting_uncached_tokens"] == 10**7         # 1e6 s at 10 tokens/s


def test_include_as_sglang_core_always_queues_on_request():
    signals = kvadmit(0.5, 0.4, 2)
    core = v1_loads_report(VLLM_IDLE, signals, {"core"}, 50.0)["loads"][0]
    assert "queues" not in core and "memory" not in core
    smg = v1_loads_report(VLLM_IDLE, signals, {"core", "disagg", "queues", "memory"}, 50.0)
    assert_smg_schema(smg)
    rank = smg["loads"][0]
    assert rank["queues"] == {"waiting": 2}
    assert not {"memory", "disagg_mode", "kv_transfer_latency_ms"} & set(rank)   # not known
    assert {k: v for k, v in rank.items() if k != "queues"} == core
    assert v1_loads_report(VLLM_IDLE, signals, {"all"}, 50.0)["loads"][0]["queues"] == {
        "waiting": 2}


def test_without_kvadmits_series_the_report_is_vllms():
    vllm = {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 5.0,
            "vllm:kv_cache_usage_perc": 0.61234}
    report = v1_loads_report(vllm, None, {"core"}, 12.345, state="failed-open")
    assert_smg_schema(report)
    assert report["loads"][0] == {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 5,
                                  "num_total_reqs": 8, "token_usage": 0.6123,
                                  "gen_throughput": 12.35}
    assert report["kvadmit"] == {"source": "vllm", "state": "failed-open"}
    # SMG then estimates the queue from the waiting count (5 x 1024 tokens)
    assert smg_expected_wait(report) == pytest.approx(5 * 1024 / 12.35 + 0.15 * 0.6123 / 0.3877)


def test_generation_rate_from_vllms_counter():
    rate = GenerationRate(span=1.0)
    assert rate.update(100.0, 10.0) == 0.0              # one read: no rate yet
    assert rate.update(150.0, 10.5) == 0.0              # under a second apart: kept
    assert rate.update(400.0, 12.0) == 150.0            # 300 tokens over 2 s
    assert rate.update(500.0, 12.2) == 150.0
    assert rate.update(300.0, 14.0) == 150.0            # counter went back: restart the window
    assert rate.update(1300.0, 16.0) == 500.0


def test_the_middleware_answers_v1_loads_with_its_query(prometheus_multiproc_dir):
    """SMG's exact probe through the ASGI middleware, from a real multiprocess
    directory an engine process wrote kvadmit's gauges into."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, "0.75", "0.5", "4"],  # inherits the dir
                            stdin=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if (kvadmit_signals(str(prometheus_multiproc_dir)) or {}).get(
                    "kvadmit_waiting_requests") == 4:
                break
            asyncio.run(asyncio.sleep(0.05))
        status, body = call("/v1/loads", query=b"include=core,disagg,queues,memory")
        assert status == 200
        report = json.loads(body)
        assert_smg_schema(report)
        rank = report["loads"][0]
        assert rank["num_waiting_reqs"] == 4 and rank["queues"] == {"waiting": 4}
        assert rank["token_usage"] == 0.5
        assert report["kvadmit"]["predicted_queue_delay_s"] == 0.75
        assert smg_expected_wait(report) == pytest.approx(0.75 + 0.15, abs=1e-3)
        status, body = call("/v1/loads")
        assert status == 200 and "queues" not in json.loads(body)["loads"][0]
        assert call("/v1/loads", "POST") == (404, b"app")
        assert call("/v1/loadsx") == (404, b"app")
    finally:
        proc.communicate("")


def test_a_failed_closed_server_reads_full_to_smg():
    """kvadmit failed closed (it refuses every request until a restart): token_usage
    1.0, at or over any SMG overload threshold (`--worker-overload-token-usage` is at
    most 1.0), so SMG leaves the server out while another is under it."""
    report = v1_loads_report(VLLM_IDLE, None, {"core"}, 0.0, state="failed-closed")
    assert_smg_schema(report)
    assert report["loads"][0]["token_usage"] == 1.0
    assert report["kvadmit"] == {"source": "vllm", "state": "failed-closed"}
