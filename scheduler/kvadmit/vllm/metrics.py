"""kvadmit's counters as Prometheus metrics of the engine-core process.

vLLM's scheduler statistics cross to the API server as a msgspec struct that
drops fields it does not know, so kvadmit does not ride on them. Its counters
live in the engine-core process, where the scheduler runs; `vllm serve`'s
`/metrics` shows them when Prometheus multiprocess mode is on, i.e. when
PROMETHEUS_MULTIPROC_DIR is set before `vllm serve` starts (prometheus_client's
documented route for several processes). Without it they stay in the engine
process and `/metrics` does not list them. `LLM.get_metrics()` lists them as
`vllm:kvadmit_*` through a collector kvadmit's `vllm.general_plugins` entry point adds
to the front end's registry (`register_bridge`, same multiprocess mode); in-process
code can always read `scheduler.kvadmit.port.stats()`.
"""
from __future__ import annotations

from kvadmit.protocol import AGENT_EXITS_HELP, AGENT_OVERDUE_HELP, HELD_HELP

_METRICS = None


class KvadmitMetrics:
    """Counters mirroring `AdmissionCore.stats()`, advanced by the difference."""

    def __init__(self):
        from prometheus_client import Counter, Gauge

        self.arrived = Counter("kvadmit_arrived", "Sequences that reached kvadmit's queue or "
                               "were refused there (a refused n>1 request counts once)")
        self.admitted = Counter("kvadmit_admitted", "Requests kvadmit let start")
        self.held = Counter("kvadmit_held", HELD_HELP, ["reason"])
        self.rejected = Counter("kvadmit_rejected", "Requests refused at arrival (an n>1 "
                                "request once), or shed from the queue", ["reason"])
        self.aborted = Counter("kvadmit_aborted", "Accepted sequences that left without "
                               "finishing (client cancelled, engine error)")
        self.preempted = Counter("kvadmit_preemptions", "Running requests preempted")
        self.displaced = Counter("kvadmit_displacements", "Of the preempted, those preempted "
                                 "for a waiting request kvadmit let take their KV (priority "
                                 "retraction, flow displacement)")
        self.paused = Counter("kvadmit_paused", "Steps running requests were paused "
                              "(shortfall: pause), counted per request")
        self.finished = Counter("kvadmit_finished", "Requests finished")
        self.predicted = Counter("kvadmit_predicted_output_tokens",
                                 "Output tokens predicted at admission, for finished requests")
        self.actual = Counter("kvadmit_actual_output_tokens",
                              "Output tokens actually generated, for finished requests")
        self.waiting = Gauge("kvadmit_waiting_requests", "Requests waiting", multiprocess_mode="livesum")
        self.quantile = Gauge("kvadmit_length_quantile", "The output-length quantile the "
                              "adaptive and auto policies predict by (their controller "
                              "raises it after preemptions)", multiprocess_mode="livemax")
        # The online step-time fit T = a + b * tokens + c * context, per engine process.
        self.step_a = Gauge("kvadmit_step_time_base_seconds",
                            "Step-time fit: seconds a step (a)", multiprocess_mode="liveall")
        self.step_b = Gauge("kvadmit_step_time_per_token_seconds",
                            "Step-time fit: seconds per scheduled token (b)", multiprocess_mode="liveall")
        self.step_c = Gauge("kvadmit_step_time_per_context_token_seconds",
                            "Step-time fit: seconds per context token (c)", multiprocess_mode="liveall")
        self.agent_window = Gauge("kvadmit_agent_window",
                                  "Active-agent window W (sessions that may be active)",
                                  multiprocess_mode="livesum")
        self.active_sessions = Gauge("kvadmit_active_sessions", "Sessions inside the agent window",
                                     multiprocess_mode="livesum")
        self.window_exits = Counter("kvadmit_agent_window_exits", AGENT_EXITS_HELP, ["why"])
        self.window_overdue = Counter("kvadmit_agent_window_overdue", AGENT_OVERDUE_HELP)
        # What a router can use (AdmissionCore.router_signals): summed over engine
        # processes for headroom, the largest for pressure and delay.
        self.headroom = Gauge("kvadmit_kv_headroom_blocks",
                              "KV blocks the admission policy could still admit without a "
                              "forecast shortfall, after the waiting requests' prompts",
                              multiprocess_mode="livesum")
        self.pressure = Gauge("kvadmit_admission_pressure",
                              "Forecast KV demand (running peak + waiting prompts) over the "
                              "pool; above 1: more is queued than fits", multiprocess_mode="livemax")
        self.queue_delay = Gauge("kvadmit_predicted_queue_delay_seconds",
                                 "Predicted queueing delay of a request arriving now",
                                 multiprocess_mode="livemax")
        self.internal_errors = Counter(
            "kvadmit_internal_errors", "kvadmit's own errors inside the engine; from the "
            "first, the engine schedules as vLLM alone and kvadmit fails open, or closed "
            "(on_internal_error: closed; see kvadmit_failed_closed)")
        self.failed_closed = Gauge(
            "kvadmit_failed_closed", "1 once kvadmit failed inside the engine under "
            "on_internal_error: closed: it refuses every request (503 kvadmit:failed_closed) "
            "until the engine is restarted; else 0", multiprocess_mode="livemax")
        self.last: dict = {}
        self._gauges: dict[int, float] = {}       # id(gauge) -> the value last set
        self._children: dict[tuple, object] = {}  # (id(counter), label) -> its series

    def update(self, stats: dict) -> None:
        """Advances the counters by what changed since the last update and sets the
        gauges. It runs every engine step, and each write to a multiprocess series takes
        a lock and a file write: nothing is written where nothing changed (a zero
        increment, a gauge at its value)."""
        last, self.last = self.last, stats

        def delta(key, *path):
            now, before = stats, last
            for k in (key, *path):
                now = now.get(k, 0) if isinstance(now, dict) else 0
                before = before.get(k, 0) if isinstance(before, dict) else 0
            return max(now - before, 0)

        for counter, key in ((self.arrived, "arrived"), (self.admitted, "admitted"),
                             (self.aborted, "aborted"), (self.preempted, "preempted"),
                             (self.displaced, "displaced"), (self.paused, "paused"),
                             (self.finished, "finished")):
            _inc(counter, delta(key))
        for counter, key in ((self.held, "held"), (self.rejected, "rejected")):
            if stats[key] != last.get(key):
                for reason in stats[key]:
                    _inc(self._child(counter, reason), delta(key, reason))
        lp, lp0 = stats["length_predictions"], last.get("length_predictions", {})
        n, n0 = lp["finished"], lp0.get("finished", 0)
        _inc(self.predicted, max(lp["mean_predicted"] * n - lp0.get("mean_predicted", 0) * n0, 0))
        _inc(self.actual, max(lp["mean_actual"] * n - lp0.get("mean_actual", 0) * n0, 0))
        fit, window = stats["step_time_fit"], stats["agent_window"]
        for gauge, value in ((self.waiting, stats["waiting"]), (self.quantile, stats["quantile"]),
                             (self.step_a, fit["a"]), (self.step_b, fit["b"]),
                             (self.step_c, fit["c"]), (self.agent_window, window["size"]),
                             (self.headroom, stats["kv_headroom_blocks"]),
                             (self.pressure, stats["admission_pressure"]),
                             (self.queue_delay, stats["predicted_queue_delay_s"]),
                             (self.active_sessions, window["active_sessions"])):
            if self._gauges.get(id(gauge)) != value:
                gauge.set(value)
                self._gauges[id(gauge)] = value
        if window["exits"] != last.get("agent_window", {}).get("exits"):
            for why in window["exits"]:
                _inc(self._child(self.window_exits, why), delta("agent_window", "exits", why))
        _inc(self.window_overdue, delta("agent_window", "overdue"))

    def _child(self, counter, label: str):
        """A labelled counter's series, made once (made, it is exported, at 0)."""
        key = (id(counter), label)
        if key not in self._children:
            self._children[key] = counter.labels(label)
        return self._children[key]


def _inc(counter, amount: float) -> None:
    if amount:
        counter.inc(amount)


def process_metrics() -> KvadmitMetrics | None:
    """The process's one set of kvadmit metrics (None without prometheus_client)."""
    global _METRICS
    if _METRICS is None:
        try:
            _METRICS = KvadmitMetrics()
        except ImportError:
            return None
    return _METRICS


class _EngineSeriesBridge:
    """Prometheus collector: the kvadmit series written by other processes (engine
    cores) in multiprocess mode, renamed `vllm:kvadmit_*` for `LLM.get_metrics()`."""

    def __init__(self, path: str):
        self._path = path

    def collect(self):
        from prometheus_client.metrics_core import Metric
        from prometheus_client.multiprocess import MultiProcessCollector

        for family in MultiProcessCollector(None, path=self._path).collect():
            if not family.name.startswith("kvadmit_"):
                continue
            renamed = Metric("vllm:" + family.name, family.documentation, family.type)
            for sample in family.samples:
                renamed.add_sample("vllm:" + sample.name, sample.labels, sample.value)
            yield renamed


_BRIDGED = False


def register_bridge() -> bool:
    """Adds the bridge to this process's default registry once, in multiprocess mode."""
    global _BRIDGED
    import os

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if _BRIDGED or not path:
        return _BRIDGED
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    REGISTRY.register(_EngineSeriesBridge(path))
    _BRIDGED = True
    return True
