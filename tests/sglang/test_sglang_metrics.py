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


def test_internal_state_carries_kvadmit_stats(kvadmit_hooks):
    h = busy_harness("peak")
    for _ in range(5):
        h.step()
    out = plugin.after_get_internal_state(GetInternalStateReqOutput(internal_state={"x": 1}), h.sched)
    assert out.internal_state["x"] == 1
    assert out.internal_state["kvadmit"]["policy"] == "peak"
    assert out.internal_state["kvadmit"]["running"] == h.adapter.core.num_running > 0
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
