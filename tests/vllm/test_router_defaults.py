"""The issue's scenario behind vLLM's own router with its default flags
(bench/router_defaults.py): two kvadmit instances capped at one waiting request,
kvadmit's DEFAULT overload status (no overload_status set), `vllm-router --policy
round_robin` and nothing else; a burst of 24 requests, then a second wave of 8 sent
8 s later. Every request is served or refused with a status and a Retry-After the
client can read; the second wave is served by both instances, and no circuit breaker
is left open (with 503, both breakers opened within the burst and the second wave got
nothing: bench/results/router_defaults.json)."""
import asyncio
import pathlib
import shutil
import sys

import pytest

if shutil.which("vllm-router") is None and not (pathlib.Path(sys.executable).parent / "vllm-router").exists():
    pytest.skip("vllm-router is not installed (.ci/run installs it)", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import router_defaults as rd  # noqa: E402
from router_fleet import Front, Setup  # noqa: E402


def test_a_burst_then_a_wave_behind_vllm_routers_defaults_loses_no_instance(model_dir, tmp_path):
    kvadmit = {"max_queued_requests": 1}
    with rd.Pair(model_dir, kvadmit, str(tmp_path)) as pair:
        setup = Setup("vllm-router/round_robin", "kvadmit", "vllm-router",
                      ("--policy", "round_robin"), kvadmit)
        with Front(setup, pair.bases, str(tmp_path)) as front:
            burst, wave2 = asyncio.run(rd.waves(front.url, model_dir, front, pair.bases))
    for row in (burst, wave2):
        assert row["lost"] == 0, row
        assert row["served"] + row["refused"] == row["requests"], row
        # a refusal reaches the client with its hint, in the header and the body
        assert row["with_retry_after_header"] == row["with_body_number"] == row["refused"], row
        assert set(row["refused_by_status"]) <= {"429"}, row
    assert burst["engine_refusals"] > 0, burst          # the burst did overflow the caps
    assert wave2["served"] == wave2["requests"] == 8, wave2
    assert all(n >= 1 for n in wave2["served_per_instance"]), wave2
    assert wave2["breaker_trips"] == 0
    assert all(state == 0 for state in wave2["breaker_state_after"].values()), wave2
