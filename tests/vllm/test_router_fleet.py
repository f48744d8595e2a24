"""Three `vllm serve` instances with kvadmit behind vLLM's own router, vllm-router
(bench/router_fleet.py's set-up), with the documented recipe: kvadmit answers overload
with 429 (its default `overload_status`, not set here), which vllm-router retries on
another worker without counting it against the worker's circuit breaker, and the router
polls `GET /get_load` every second for `power_of_two`. A burst twice what the fleet
holds at once, half of it streaming: every request is served or refused with 429 and a
Retry-After before its first byte (none lost), no breaker opens, every instance serves,
and each instance's counters add up."""
import asyncio
import pathlib
import shutil
import sys
import time

import pytest

pytest.importorskip("httpx")
if shutil.which("vllm-router") is None and not (pathlib.Path(sys.executable).parent / "vllm-router").exists():
    pytest.skip("vllm-router is not installed (.ci/run installs it)", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import router_fleet as rf  # noqa: E402
from serving import metrics  # noqa: E402

CAP = 2        # waiting requests per instance


def test_a_burst_past_the_fleet_is_served_or_refused_with_429_and_no_breaker_opens(model_dir,
                                                                                   tmp_path):
    setup = rf.Setup("kvadmit/recipe", "kvadmit", "vllm-router", rf.RECIPE_FLAGS,
                     {"max_queued_requests": CAP})          # overload_status: the default, 429
    prompts = [[(i * 7919 + k) % 997 + 3 for k in range(60)] for i in range(48)]
    requests = [(0.02 * i, p, 64, i % 2 == 0) for i, p in enumerate(prompts)]
    with rf.Instances(model_dir, setup, 3, 0, str(tmp_path)) as inst:
        with rf.Front(setup, inst.bases, str(tmp_path)) as front:
            outcomes = asyncio.run(rf.drive(front.url, model_dir, requests))
            trips = front.breaker_trips()
        time.sleep(1.0)
        per_instance = [metrics(b) for b in inst.bases]
    kinds = [o.kind for o in outcomes]
    assert "lost" not in kinds, [o for o in outcomes if o.kind == "lost"]
    refused = [o for o in outcomes if o.kind == "refused"]
    # The burst exceeds what the fleet holds (the test means something): the engines
    # refused; the router retries a 429 on another worker, so the client may see none.
    assert sum(v for m in per_instance for k, v in m.items()
               if k.startswith("kvadmit_rejected_total")) >= 1
    for o in refused:
        assert o.status == 429 and o.detail.startswith("kvadmit:queue_full:"), o
        assert o.retry_after is not None and int(o.retry_after) >= 1, o
    assert trips == 0
    assert all(o.tokens == 64 for o in outcomes if o.kind == "served" and not o.stream)
    for m in per_instance:
        assert m["kvadmit_finished_total"] == m["kvadmit_admitted_total"] >= 1
        assert m["kvadmit_waiting_requests"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
    assert sum(m["kvadmit_finished_total"] for m in per_instance) == kinds.count("served")
