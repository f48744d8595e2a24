"""kvadmit's numbers where SGLang shows its own: Prometheus series (kvadmit:*)
and the per-rank internal state behind GET /server_info."""
import random

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py
prometheus_client = pytest.importorskip("prometheus_client")

from sglang.srt.managers.io_struct import GetInternalStateReqOutput  # noqa: E402

from kvadmit import AdmissionConfig  # noqa: E402
from kvadmit.sglang import plugin  # noqa: E402
from kvadmit.sglang.metrics import PrometheusExport, exporter_for_scheduler  # noqa: E402


def busy_harness(policy="overcommit"):
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({"policy": policy, "max_queued_requests": 30}),
                pool_tokens=1024)
    rng = random.Random(3)
    for i in range(32):
        h.submit(make_req(f"m{i}", rng.randint(20, 80), 256, out_len=rng.choice([16, 256])))
    return h


def test_prometheus_series_follow_the_core(kvadmit_hooks):
    registry = prometheus_client.CollectorRegistry()
    labels = {"model_name": "m", "engine_type": "unified"}
    h = busy_harness()
    h.adapter.exporter = PrometheusExport(labels, registry=registry)
    h.run()
    stats = h.adapter.stats()
    get = registry.get_sample_value
    assert stats["preempted"] > 0  # overcommit on a small pool retracts
    assert get("kvadmit:admitted_total", labels) == stats["admitted"]
    assert get("kvadmit:preempted_total", labels) == stats["preempted"]
    assert get("kvadmit:finished_total", labels) == stats["finished"] == 30
    assert get("kvadmit:rejected_total", {**labels, "reason": "queue_full"}) == 2
    assert get("kvadmit:running", labels) == 0
    assert get("kvadmit:new_token_ratio", labels) == pytest.approx(stats["new_token_ratio"])
    # the router signals: an idle engine has the whole pool as headroom, no pressure
    assert get("kvadmit:kv_headroom_blocks", labels) == stats["kv_headroom_blocks"] == \
        h.adapter.port.core.num_blocks
    assert get("kvadmit:admission_pressure", labels) == stats["admission_pressure"] == 0.0
    assert get("kvadmit:predicted_queue_delay_s", labels) == 0.0


def test_internal_state_carries_kvadmit_stats(kvadmit_hooks):
    h = busy_harness("peak")
    for _ in range(5):
        h.step()
    out = plugin.after_get_internal_state(GetInternalStateReqOutput(internal_state={"x": 1}), h.sched)
    assert out.internal_state["x"] == 1
    assert out.internal_state["kvadmit"]["policy"] == "peak"
    assert out.internal_state["kvadmit"]["running"] == h.adapter.port.core.num_running > 0
    from sglang_harness import Harness

    plain = plugin.after_get_internal_state(GetInternalStateReqOutput(internal_state={}),
                                            Harness(None).sched)
    assert "kvadmit" not in plain.internal_state  # no configuration: nothing added


def test_no_exporter_without_sglang_metrics(kvadmit_hooks):
    from types import SimpleNamespace

    assert exporter_for_scheduler(SimpleNamespace()) is None
    off = SimpleNamespace(metrics_reporter=SimpleNamespace(enable_metrics=False,
                                                           metrics_collector=None))
    assert exporter_for_scheduler(off) is None


def test_slo_and_agent_series(kvadmit_hooks):
    """New reasons and decisions appear (at 0 from the first step on), and the
    step-time fit and the agent window are gauges."""
    from sglang_harness import Harness, make_req

    registry = prometheus_client.CollectorRegistry()
    labels = {"model_name": "m", "engine_type": "unified"}
    h = Harness(AdmissionConfig.from_dict({
        "slo_guard": True, "agent_window": True, "agent_window_init": 1, "agent_window_max": 1,
        "agent_interval_s": 0.0, "agent_idle_s": 0.0}), step_model=(0.01, 1e-4, 1e-6))
    h.adapter.exporter = PrometheusExport(labels, registry=registry)
    h.step()
    get = registry.get_sample_value
    for reason in ("queue_full", "slo_infeasible", "invalid"):
        assert get("kvadmit:rejected_total", {**labels, "reason": reason}) == 0
    for decision in ("hold_slo", "hold_agent"):
        assert get("kvadmit:held_total", {**labels, "decision": decision}) == 0

    assert not h.submit(make_req("tight", 100, 4, custom_params={"kvadmit": {"ttft_slo_s": 0.001}}))
    assert not h.submit(make_req("typo", 100, 4, custom_params={"kvadmit": {"ttft": 1}}))
    assert h.submit(make_req("a", 50, 4, custom_params={"kvadmit": {"session": "A"}}))
    assert h.submit(make_req("b", 50, 4, custom_params={"kvadmit": {"session": "B"}}))
    h.run()
    stats = h.adapter.stats()
    assert get("kvadmit:rejected_total", {**labels, "reason": "slo_infeasible"}) == 1
    assert get("kvadmit:rejected_total", {**labels, "reason": "invalid"}) == 1
    assert get("kvadmit:held_total", {**labels, "decision": "hold_agent"}) == \
        stats["held"]["hold_agent"] > 0
    fit = stats["step_time_fit"]
    assert get("kvadmit:step_time_a_seconds", labels) == pytest.approx(fit["a"])
    assert get("kvadmit:step_time_c_seconds", labels) == pytest.approx(fit["c"])
    assert get("kvadmit:step_time_observations", labels) == fit["observations"] > 0
    assert get("kvadmit:agent_window_size", labels) == 1.0
    assert get("kvadmit:agent_active_sessions", labels) == stats["agent_window"]["active_sessions"]
    # B waited outside the window until A, idle, expired out of it: counted by why
    assert get("kvadmit:agent_window_exits_total", {**labels, "why": "expired"}) == \
        stats["agent_window"]["exits"]["expired"] >= 1
    assert get("kvadmit:agent_window_exits_total", {**labels, "why": "paused"}) == 0
