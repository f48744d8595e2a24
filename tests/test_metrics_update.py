"""kvadmit's Prometheus series follow the core's counters: advanced by what changed,
gauges set to the core's values, labelled series exported (at 0) from the first
update. Each update writes only what changed (it runs every engine step)."""
import pytest

from helpers import add_running, make_core

prometheus_client = pytest.importorskip("prometheus_client")


def value(name, **labels):
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_series_follow_the_core_and_a_repeated_update_changes_nothing(monkeypatch):
    from kvadmit.vllm.metrics import process_metrics
    metrics = process_metrics()
    metrics.last = {}                                  # this test's core from its start
    core = make_core("peak", num_blocks=20, block_size=4)
    start = {k: value(f"kvadmit_{k}_total") for k in ("arrived", "admitted")}
    queue_full = value("kvadmit_rejected_total", reason="queue_full")
    metrics.update(core.stats())
    assert prometheus_client.REGISTRY.get_sample_value(
        "kvadmit_held_total", {"reason": "hold_slo"}) is not None        # exported at 0
    add_running(core, 8, 4)
    add_running(core, 8, 4)
    writes = []
    original = type(metrics.arrived).inc
    monkeypatch.setattr(type(metrics.arrived), "inc", lambda self, a=1: (writes.append(a),
                                                                         original(self, a)))
    metrics.update(core.stats())
    assert value("kvadmit_arrived_total") - start["arrived"] == 2
    assert value("kvadmit_admitted_total") - start["admitted"] == 2
    assert value("kvadmit_rejected_total", reason="queue_full") == queue_full
    assert value("kvadmit_waiting_requests") == core.stats()["waiting"]
    assert sorted(writes) == [2, 2]                    # arrived and admitted only: no zero writes
    writes.clear()
    metrics.update(core.stats())                       # nothing changed: nothing written
    assert writes == []
    assert value("kvadmit_arrived_total") - start["arrived"] == 2
