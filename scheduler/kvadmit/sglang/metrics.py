"""kvadmit's counters next to SGLang's Prometheus metrics.

SGLang runs prometheus_client in multiprocess mode (PROMETHEUS_MULTIPROC_DIR
is set before the scheduler processes start), so metrics created in a
scheduler process reach the HTTP server's ``/metrics``. kvadmit exports
``kvadmit:*`` series with the same labels as SGLang's scheduler metrics, only
where SGLang's own scheduler metrics are on (``--enable-metrics``).

Without metrics the numbers are still reachable: ``adapter.stats()`` per rank in
``GET /server_info`` (``internal_states[i]["kvadmit"]``).

kvadmit's own failure (`kvadmit.sglang.failure`): ``kvadmit:internal_errors_total``
and ``kvadmit:failed_closed`` (1 once failed closed), both at 0 from the start, and the
refusals it makes failed closed as ``kvadmit:rejected_total{reason="failed_closed"}``,
as vLLM's ``kvadmit_*`` series.
"""
from __future__ import annotations

from typing import Optional

from kvadmit.protocol import AGENT_EXITS_HELP, AGENT_OVERDUE_HELP, FAILED_CLOSED, HELD_HELP

# stats() key -> (metric suffix, documentation); counters export the growth.
COUNTERS = {
    "arrived": "requests that reached kvadmit's queue",
    "admitted": "admissions (a retracted request counts again when re-admitted)",
    "preempted": "running requests retracted back to the queue",
    "displaced": "of those, evicted for a waiting request kvadmit let take their KV "
                 "(priority retraction, flow displacement)",
    "finished": "requests that finished",
    "aborted": "requests aborted or dropped while tracked",
    "requeued": "retracted or preempted requests re-queued by SGLang",
}
GAUGES = {
    "waiting": "requests waiting in kvadmit's queue",
    "running": "requests kvadmit counts as running",
    "queued_tokens": "prompt tokens waiting for prefill",
    "new_token_ratio": "predict policy's new_token_ratio",
    "quantile": "adaptive policy's output-length quantile",
    "kv_headroom_blocks": "KV pages the admission policy could still admit without a forecast "
                          "shortfall, after the waiting requests' prompts",
    "admission_pressure": "forecast KV demand (running peak + waiting prompts) over the pool; "
                          "above 1: more is queued than fits",
    "predicted_queue_delay_s": "predicted queueing delay of a request arriving now, seconds",
}
# Gauges from stats()'s nested dicts: (dict, key) -> (metric suffix, documentation).
NESTED_GAUGES = {
    ("step_time_fit", "a"): ("step_time_a_seconds", "step-time fit: seconds a step"),
    ("step_time_fit", "b"): ("step_time_b_seconds", "step-time fit: seconds per scheduled token"),
    ("step_time_fit", "c"): ("step_time_c_seconds", "step-time fit: seconds per context token"),
    ("step_time_fit", "observations"): ("step_time_observations",
                                        "engine steps the step-time fit has seen"),
    ("agent_window", "size"): ("agent_window_size", "agent window W (sessions that may be active)"),
    ("agent_window", "active_sessions"): ("agent_active_sessions",
                                          "sessions inside the agent window"),
}


class PrometheusExport:
    """Publishes `SGLangAdmission.stats()` as Prometheus series."""

    def __init__(self, labels: dict, registry=None):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        names = list(labels)
        self.labels = dict(labels)
        self._last: dict = {}
        self.counters = {
            key: Counter(f"kvadmit:{key}", doc, labelnames=names, registry=registry)
            for key, doc in COUNTERS.items()
        }
        self.rejected = Counter("kvadmit:rejected", "arrivals refused, by reason",
                                labelnames=names + ["reason"], registry=registry)
        self.held = Counter("kvadmit:held", HELD_HELP,
                            labelnames=names + ["decision"], registry=registry)
        self.window_exits = Counter("kvadmit:agent_window_exits", AGENT_EXITS_HELP,
                                    labelnames=names + ["why"], registry=registry)
        self.window_overdue = Counter("kvadmit:agent_window_overdue", AGENT_OVERDUE_HELP,
                                      labelnames=names, registry=registry)
        self.gauges = {
            key: Gauge(f"kvadmit:{key}", doc, labelnames=names, registry=registry,
                       multiprocess_mode="mostrecent")
            for key, doc in GAUGES.items()
        }
        self.nested_gauges = {
            path: Gauge(f"kvadmit:{name}", doc, labelnames=names, registry=registry,
                        multiprocess_mode="mostrecent")
            for path, (name, doc) in NESTED_GAUGES.items()
        }
        self.internal_errors = Counter(
            "kvadmit:internal_errors", "kvadmit's own errors inside the scheduler; from the "
            "first, SGLang schedules alone and kvadmit fails open, or closed "
            "(on_internal_error: closed; see kvadmit:failed_closed)",
            labelnames=names, registry=registry)
        self.failed_closed = Gauge(
            "kvadmit:failed_closed", "1 once kvadmit failed inside the scheduler under "
            "on_internal_error: closed: it refuses every request (503 kvadmit:failed_closed) "
            "until the server is restarted; else 0", labelnames=names, registry=registry,
            multiprocess_mode="max")   # any rank failed closed: the server is
        self.internal_errors.labels(**self.labels)
        self.failed_closed.labels(**self.labels).set(0)

    def record_failure(self, closed: bool) -> None:
        """One internal error (`kvadmit.sglang.failure.record`)."""
        self.internal_errors.labels(**self.labels).inc()
        if closed:
            self.failed_closed.labels(**self.labels).set(1)

    def count_failed_closed(self, n: int) -> None:
        """``n`` requests refused because kvadmit failed closed (not the core's refusals:
        the core is not called any more)."""
        if n > 0:
            self.rejected.labels(**self.labels, reason=FAILED_CLOSED).inc(n)

    def _grow(self, metric, key, value, **extra) -> None:
        if key not in self._last:  # the series exists (at 0) from the first publish on
            metric.labels(**self.labels, **extra)
        delta = value - self._last.get(key, 0)
        if delta > 0:
            metric.labels(**self.labels, **extra).inc(delta)
        self._last[key] = value

    def publish(self, stats: dict) -> None:
        for key, metric in self.counters.items():
            self._grow(metric, key, stats.get(key, 0))
        for reason, n in stats.get("rejected", {}).items():
            self._grow(self.rejected, ("rejected", reason), n, reason=reason)
        for decision, n in stats.get("held", {}).items():
            self._grow(self.held, ("held", decision), n, decision=decision)
        window = stats.get("agent_window", {})
        for why, n in window.get("exits", {}).items():
            self._grow(self.window_exits, ("agent_window_exits", why), n, why=why)
        self._grow(self.window_overdue, "agent_window_overdue", window.get("overdue", 0))
        for key, metric in self.gauges.items():
            metric.labels(**self.labels).set(stats.get(key, 0))
        for (group, key), metric in self.nested_gauges.items():
            metric.labels(**self.labels).set(stats.get(group, {}).get(key, 0))


_EXPORTERS: dict = {}


def exporter_for_scheduler(scheduler) -> Optional[PrometheusExport]:
    """One exporter per label set and process, where SGLang's scheduler metrics are on."""
    reporter = getattr(scheduler, "metrics_reporter", None)
    collector = getattr(reporter, "metrics_collector", None)
    if reporter is None or not getattr(reporter, "enable_metrics", False) or collector is None:
        return None
    labels = dict(getattr(collector, "labels", {}) or {})
    key = tuple(sorted(labels.items()))
    if key not in _EXPORTERS:
        _EXPORTERS[key] = PrometheusExport(labels)
    return _EXPORTERS[key]
