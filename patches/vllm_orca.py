"""vLLM 0.32, 0.33 and 0.34: kvadmit's router signals in vLLM's ORCA load report.

A request that carries `endpoint-load-metrics-format: TEXT` (or `JSON`) gets an
`endpoint-load-metrics` response header with vLLM's `kv_cache_usage_perc` and
`num_requests_waiting` (vllm/entrypoints/serve/utils/orca_metrics.py). This patch
adds kvadmit's signals to its named metrics (`kvadmit_kv_headroom_blocks`,
`kvadmit_admission_pressure`, `kvadmit_predicted_queue_delay_seconds`) and sets
ORCA's `application_utilization` to the admission pressure (what Envoy's
client-side weighted round robin reads). The signals are the engine processes'
Prometheus series, which reach the API server in multiprocess mode
(PROMETHEUS_MULTIPROC_DIR; kvadmit's bridge names them `vllm:kvadmit_*`); without
them the header is vLLM's own.

Applied in every vLLM process by the `vllm.general_plugins` entry point; both
patched functions are module globals that `metrics_header` looks up per call.
"""
from __future__ import annotations

import json

from kvadmit_patches import Target, require, wrap

TARGET = "vllm.entrypoints.serve.utils.orca_metrics"
# The same functions on each: orca_metrics.py is unchanged since 0.32.0.
SERIES = ("0.32", "0.33", "0.34")
TARGETS = (Target(f"{TARGET}:get_named_metrics_from_prometheus"),
           Target(f"{TARGET}:get_metrics_snapshot"),
           Target(f"{TARGET}:create_orca_header", ("metrics_format", "named_metrics")))
# vLLM's name of the bridged series -> the ORCA named metric
SIGNALS = {
    "vllm:kvadmit_kv_headroom_blocks": "kvadmit_kv_headroom_blocks",
    "vllm:kvadmit_admission_pressure": "kvadmit_admission_pressure",
    "vllm:kvadmit_predicted_queue_delay_seconds": "kvadmit_predicted_queue_delay_seconds",
}
UTILIZATION = "kvadmit_admission_pressure"


def kvadmit_named_metrics(snapshot) -> list[tuple[str, float]]:
    """kvadmit's signals among vLLM's metrics snapshot, as ORCA named metrics."""
    out = []
    for metric in snapshot:
        name = SIGNALS.get(metric.name)
        if name is not None and hasattr(metric, "value"):
            out.append((name, float(metric.value)))
    return out


def with_utilization(header, metrics_format: str, named_metrics) -> dict | None:
    """vLLM's header plus `application_utilization` = the admission pressure."""
    util = dict((n, v) for n, v in named_metrics if isinstance(n, str)).get(UTILIZATION)
    if not header or util is None:
        return header
    value = header["endpoint-load-metrics"]
    if metrics_format.lower() == "text":
        value = f"{value}, application_utilization={util}"
    else:
        report = json.loads(value[len("JSON "):])
        report["application_utilization"] = util
        value = f"JSON {json.dumps(report)}"
    return {**header, "endpoint-load-metrics": value}


def apply() -> bool:
    """Installs both wrappers once; PatchUnavailable (nothing done) where it cannot
    apply."""
    require(__name__)
    import vllm.entrypoints.serve.utils.orca_metrics as orca

    def make_named(original):
        def get_named_metrics_from_prometheus():
            return original() + kvadmit_named_metrics(orca.get_metrics_snapshot())
        return get_named_metrics_from_prometheus

    def make_header(original):
        def create_orca_header(metrics_format, named_metrics):
            return with_utilization(original(metrics_format, named_metrics), metrics_format,
                                    named_metrics)
        return create_orca_header

    wrap(orca, "get_named_metrics_from_prometheus", make_named)
    wrap(orca, "create_orca_header", make_header)
    return True
