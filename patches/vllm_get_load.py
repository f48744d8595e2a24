"""vLLM 0.32, 0.33 and 0.34: the load reports routers poll, `GET /get_load` (vllm-router,
sglang-router) and `GET /v1/loads` (SMG, sglang-router's successor).

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
"failed-open"`, once kvadmit failed open inside an engine (its series then stand
still). Once it failed closed (`on_internal_error: closed`: it refuses every request
until a restart) the answer is `{"load": 10**15, "source": "kvadmit", "kvadmit":
"failed-closed"}`, a load no router prefers, and `GET /health` answers 503 with
`{"kvadmit": "failed-closed", ...}`; otherwise `/health` is vLLM's own answer with
kvadmit's state in an `x-kvadmit-state` header (`ok`, `failed-open`).

`GET /v1/loads?include=...` answers SMG 1.13's load probe in SGLang's schema (SMG's
`WorkerLoadResponse`, openai_protocol::worker in github.com/smg-project/smg): one
rank for the whole server, with kvadmit's numbers where SMG's expected-wait score
and overload check read them (`v1_loads_report`; docs/router.md has the table).

Applied in every vLLM process by the `vllm.general_plugins` entry point, as an
ASGI middleware installed with vLLM's own ones; it answers the GET paths in
`ROUTES` (one function each, taking the query string) and passes everything else
through.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from urllib.parse import parse_qs

from kvadmit import failed_state
from kvadmit.failed_state import answer_failed_closed, with_state_header
from kvadmit_patches import MIDDLEWARE_HOOK, add_app_middleware, require

TARGET = "vllm.entrypoints.launchers.app.init_entrypoints_middleware"
SERIES = ("0.32", "0.33", "0.34")     # the same hook as vllm_retry_after.py
TARGETS = (MIDDLEWARE_HOOK,)
# kvadmit's engine series (kvadmit.vllm.metrics), as written by the engine cores
DELAY = "kvadmit_predicted_queue_delay_seconds"
FAILED = "kvadmit_internal_errors"        # a counter: its sample is FAILED + "_total"
FAILED_CLOSED = "kvadmit_failed_closed"   # 1 once an engine failed closed (livemax)
# /get_load's load once kvadmit failed closed: above any load it reports otherwise
# (at most 10**12 + 999), so a router comparing loads never picks this server
FAILED_CLOSED_LOAD = 10**15
HEALTH = "/health"
PRESSURE = "kvadmit_admission_pressure"
WAITING = "kvadmit_waiting_requests"
# vLLM's own gauges in the API server's registry (the fallback)
RUNNING, VLLM_WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
VLLM_COUNTS = (RUNNING, VLLM_WAITING)
KV_USAGE = "vllm:kv_cache_usage_perc"
GENERATED = "vllm:generation_tokens"      # a counter: its sample is GENERATED + "_total"
# SMG's expected-wait divisor when a worker reports no generation rate
# (`--least-load-default-throughput`, 2000 tokens/s by default)
SMG_DEFAULT_THROUGHPUT = 2000.0


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

    wanted = {DELAY, PRESSURE, WAITING, FAILED, FAILED_CLOSED}
    found: dict[str, float] = {}
    for family in MultiProcessCollector(None, path=path).collect():
        if family.name in wanted:
            for sample in family.samples:
                if sample.name in (family.name, family.name + "_total"):
                    found[family.name] = float(sample.value)
    return found if DELAY in found and PRESSURE in found else None


def vllm_gauges() -> dict[str, float]:
    """vLLM's own series in the API server's registry (summed over their label sets):
    running and waiting requests, KV usage (the largest), generated tokens so far."""
    from prometheus_client import REGISTRY

    found: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name in (*VLLM_COUNTS, KV_USAGE, GENERATED):
            values = [s.value for s in family.samples
                      if s.name in (family.name, family.name + "_total")]
            if values:
                found[family.name] = max(values) if family.name == KV_USAGE else sum(values)
    return found


def vllm_counts() -> int:
    """vLLM's running + waiting requests, from the API server's own gauges."""
    gauges = vllm_gauges()
    return int(sum(gauges.get(name, 0.0) for name in VLLM_COUNTS))


def engine_state() -> tuple[dict[str, float] | None, str | None]:
    """kvadmit's engine series (None without them) and, once kvadmit failed in an
    engine (its series then stand still), "failed-closed" (the engine's config said
    on_internal_error: closed) or "failed-open" with signals None."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    signals = kvadmit_signals(path) if path else None
    if signals is not None and signals.get(FAILED_CLOSED, 0) > 0:
        return None, failed_state.FAILED_CLOSED
    if signals is not None and signals.get(FAILED, 0) > 0:
        return None, failed_state.FAILED_OPEN
    return signals, None


def get_load_answer(query: str = "") -> dict:
    """`GET /get_load`: `load_report` from kvadmit's series, else vLLM's count."""
    signals, state = engine_state()
    if state == failed_state.FAILED_CLOSED:   # it refuses every request: no router picks it
        return {"load": FAILED_CLOSED_LOAD, "source": "kvadmit", "kvadmit": state}
    if signals is None:
        return {"load": vllm_counts(), "source": "vllm", **({"kvadmit": state} if state else {})}
    return load_report(signals[DELAY], signals[PRESSURE], signals.get(WAITING, 0.0))


def v1_loads_report(vllm: dict[str, float], signals: dict[str, float] | None,
                    include: set[str], throughput: float, state: str | None = None,
                    now: datetime.datetime | None = None) -> dict:
    """SMG's `WorkerLoadResponse` (SGLang's `/v1/loads` schema) for this server, as one
    rank. From kvadmit's series (`signals`): waiting = kvadmit's queue; token_usage =
    the admission pressure (forecast KV demand over the pool, capped at 1), which SMG
    reads as KV usage in its overload check and its KV barrier; queued tokens = the
    predicted queueing delay x the reported generation rate (SMG's default rate when
    none is measured), so SMG's expected-wait term, queued tokens / rate, is kvadmit's
    predicted delay in seconds. Without them (`signals` None): vLLM's own waiting
    count and KV usage, and no queued tokens (SMG then estimates the queue from the
    waiting count). `include` as SGLang's: the core fields always, `queues` on request;
    sections kvadmit has no numbers for (memory, disagg, spec, lora) are left out,
    which SMG reads as not reported."""
    running = int(vllm.get(RUNNING, 0.0))
    rank: dict = {"dp_rank": 0, "num_running_reqs": running}
    extra: dict = {"source": "vllm", **({"state": state} if state else {})}
    if signals is None:
        waiting = int(vllm.get(VLLM_WAITING, 0.0))
        rank["token_usage"] = round(min(1.0, max(0.0, vllm.get(KV_USAGE, 0.0))), 4)
        if state == failed_state.FAILED_CLOSED:    # refusing every request: at any threshold
            rank["token_usage"] = 1.0
    else:
        delay, pressure = signals[DELAY], signals[PRESSURE]
        delay = max(0.0, delay) if math.isfinite(delay) else 1e6
        pressure = min(1.0, max(0.0, pressure)) if math.isfinite(pressure) else 1.0
        waiting = int(signals.get(WAITING, 0.0))
        rate = throughput if throughput > 0 else SMG_DEFAULT_THROUGHPUT
        rank["num_waiting_uncached_tokens"] = min(2**31 - 1, math.ceil(delay * rate))
        rank["token_usage"] = round(pressure, 4)
        extra = {"source": "kvadmit", "predicted_queue_delay_s": round(delay, 6),
                 "admission_pressure": round(signals[PRESSURE], 6)}
    rank.update(num_waiting_reqs=waiting, num_total_reqs=running + waiting,
                gen_throughput=round(max(0.0, throughput), 2))
    if include & {"queues", "all"}:
        rank["queues"] = {"waiting": waiting}
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return {"timestamp": now.isoformat(), "version": engine_version(), "dp_rank_count": 1,
            "loads": [rank], "kvadmit": extra}


def engine_version() -> str:
    return str(getattr(sys.modules.get("vllm"), "__version__", ""))


class GenerationRate:
    """vLLM's generated tokens per second, from its counter between two reads at
    least `span` seconds apart (the last rate in between; 0 before the second)."""

    def __init__(self, span: float = 1.0):
        self.span, self.last, self.rate = span, None, 0.0

    def update(self, total: float, now: float) -> float:
        if self.last is None or total < self.last[1]:
            self.last = (now, total)
        elif now - self.last[0] >= self.span:
            self.rate = (total - self.last[1]) / (now - self.last[0])
            self.last = (now, total)
        return self.rate


RATE = GenerationRate()


def v1_loads_answer(query: str = "") -> dict:
    """`GET /v1/loads?include=...`: `v1_loads_report` for this server."""
    include = {part.strip() for value in parse_qs(query).get("include", [])
               for part in value.split(",")}
    vllm = vllm_gauges()
    signals, state = engine_state()
    rate = RATE.update(vllm.get(GENERATED, 0.0), time.monotonic())
    return v1_loads_report(vllm, signals, include, rate, state)


# GET path -> its answer (a function of the query string, returning a JSON object)
ROUTES = {"/get_load": get_load_answer, "/v1/loads": v1_loads_answer}


def kvadmit_state() -> str | None:
    """"ok", "failed-open" or "failed-closed" (None: no kvadmit series to read)."""
    signals, state = engine_state()
    return state or (failed_state.OK if signals is not None else None)


async def health(app, scope, receive, send) -> None:
    """`GET /health`: vLLM's own answer, with kvadmit's state in `x-kvadmit-state`;
    once kvadmit failed closed (it refuses every request until a restart), 503 and
    `{"kvadmit": "failed-closed", ...}` instead (kvadmit.failed_state)."""
    state = kvadmit_state()
    if state == failed_state.FAILED_CLOSED:
        return await answer_failed_closed(send)
    if state is None:
        return await app(scope, receive, send)
    await app(scope, receive, with_state_header(send, state))


class GetLoadMiddleware:
    """Answers the GET paths in ROUTES; every other request goes to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == HEALTH and scope["method"] == "GET":
            return await health(self.app, scope, receive, send)
        answer = ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if answer is None or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        query = scope.get("query_string", b"").decode("latin-1")
        body = json.dumps(answer(query)).encode()
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
