"""vLLM 0.32, 0.33 and 0.34: `GET /get_load`, the load report vllm-router and sglang-router poll.

vllm-router's `power_of_two` policy (and sglang-router's) asks each worker for
`GET /get_load` and sends a request to the worker of the two it draws with the
lower `"load"` (vllm-router 0.1.17 polls every `--worker-startup-check-interval`
seconds, 30 by default; vLLM itself has no such route). This patch answers it,
on the API server, with kvadmit's admission state:

    {"load": L, "predicted_wait_ms": W, "admission_pressure_permille": P,
     "waiting": n, "source": "kvadmit"}

`L = W * 1000 + P`: a two-part key in one integer, so a router comparing two
workers prefers the one where a request arriving now is expected to wait least
(W, the core's predicted queueing delay, `kvadmit_predicted_queue_delay_seconds`,
in milliseconds), and between workers where nothing waits, the one with more
room (P, the admission pressure: the forecast KV demand of the running and
waiting requests over the pool, in thousandths, capped at 999). The numbers are
the engine cores' kvadmit series, which reach the API server in Prometheus
multiprocess mode (PROMETHEUS_MULTIPROC_DIR; `kvadmit serve` turns it on). Without
them the answer is vLLM's own count, `{"load": running + waiting, "source":
"vllm"}` (what the routers' other policies read); so it is, with `"kvadmit":
"failed-open"`, once kvadmit failed inside an engine (its series then stand still).

Applied in every vLLM process by the `vllm.general_plugins` entry point, as an
ASGI middleware installed with vLLM's own ones; every other path passes through.
"""
from __future__ import annotations

import json
import math
import os

from kvadmit_patches import MIDDLEWARE_HOOK, add_app_middleware, require

TARGET = "vllm.entrypoints.launchers.app.init_entrypoints_middleware"
SERIES = ("0.32", "0.33", "0.34")     # the same hook as vllm_retry_after.py
TARGETS = (MIDDLEWARE_HOOK,)
PATH = "/get_load"
# kvadmit's engine series (kvadmit.vllm.metrics), as written by the engine cores
DELAY = "kvadmit_predicted_queue_delay_seconds"
FAILED = "kvadmit_internal_errors"        # a counter: its sample is FAILED + "_total"
PRESSURE = "kvadmit_admission_pressure"
WAITING = "kvadmit_waiting_requests"
# vLLM's own gauges in the API server's registry (the fallback)
VLLM_COUNTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def load_report(delay_s: float, pressure: float, waiting: float) -> dict:
    """The /get_load answer from kvadmit's signals (see the module docstring)."""
    wait_ms = max(0, math.ceil(1000.0 * delay_s)) if math.isfinite(delay_s) else 10**9
    permille = min(999, max(0, round(1000.0 * pressure))) if math.isfinite(pressure) else 999
    return {"load": wait_ms * 1000 + permille, "predicted_wait_ms": wait_ms,
            "admission_pressure_permille": permille, "waiting": int(waiting),
            "source": "kvadmit"}


def kvadmit_signals(path: str) -> dict[str, float] | None:
    """kvadmit's engine series in the multiprocess directory `path`, aggregated as
    each gauge's mode says (livemax, livesum); None when no engine wrote them."""
    from prometheus_client.multiprocess import MultiProcessCollector

    wanted = {DELAY, PRESSURE, WAITING, FAILED}
    found: dict[str, float] = {}
    for family in MultiProcessCollector(None, path=path).collect():
        if family.name in wanted:
            for sample in family.samples:
                if sample.name in (family.name, family.name + "_total"):
                    found[family.name] = float(sample.value)
    return found if DELAY in found and PRESSURE in found else None


def vllm_counts() -> int:
    """vLLM's running + waiting requests, from the API server's own gauges."""
    from prometheus_client import REGISTRY

    total = 0.0
    for family in REGISTRY.collect():
        if family.name in VLLM_COUNTS:
            total += sum(s.value for s in family.samples if s.name == family.name)
    return int(total)


def current_report() -> dict:
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    signals = kvadmit_signals(path) if path else None
    if signals is not None and signals.get(FAILED, 0) > 0:
        return {"load": vllm_counts(), "source": "vllm", "kvadmit": "failed-open"}
    if signals is None:
        return {"load": vllm_counts(), "source": "vllm"}
    return load_report(signals[DELAY], signals[PRESSURE], signals.get(WAITING, 0.0))


class GetLoadMiddleware:
    """Answers `GET /get_load`; every other request goes to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        body = json.dumps(current_report()).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def apply() -> bool:
    """Installs the middleware hook once; PatchUnavailable (nothing done) where it
    cannot apply."""
    require(__name__)
    add_app_middleware(GetLoadMiddleware)
    return True
