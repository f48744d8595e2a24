"""Two `vllm serve` instances with kvadmit behind a real HAProxy
(bench/haproxy_pair.py): round robin, `retry-on 503` + `option redispatch`, weights from
kvadmit's KV headroom over HAProxy's agent-check; the instances set `"overload_status":
503` (HAProxy's `retry-on` cannot name 429, kvadmit's default). One instance has a queue
cap of 1, the other of 12 (the whole burst, so it never refuses, however the burst's
arrivals interleave with its steps): the first refuses part of a burst (503,
kvadmit:queue_full) and HAProxy retries those on the second, so the client sees no
failure; both instances' counters add up and every KV block is free at idle."""
import pathlib
import shutil
import sys
import time

import pytest

pytest.importorskip("openai")
if shutil.which("haproxy") is None:
    pytest.skip("haproxy is not installed (.ci/run installs Debian's package)", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from haproxy_pair import Pair, agent_reply, burst, metrics  # noqa: E402


def test_a_refused_burst_is_retried_on_the_instance_with_room(model_dir, tmp_path):
    with Pair(model_dir, caps=(1, 12), workdir=str(tmp_path)) as pair:
        assert agent_reply(pair.bases[0]) == b"100%\n"     # idle: the whole pool is headroom
        results = burst(pair.url, model_dir, 12)
        assert results == [("ok", 64)] * 12, results
        time.sleep(1.0)                                     # the last step's counters published
        a, b = (metrics(base) for base in pair.bases)
    refused_a = a['kvadmit_rejected_total{reason="queue_full"}']
    assert refused_a >= 1                                   # instance 0 did refuse ...
    assert b['kvadmit_rejected_total{reason="queue_full"}'] == 0
    assert a["kvadmit_admitted_total"] + b["kvadmit_admitted_total"] == 12   # ... and all ran
    for m in (a, b):
        assert m["kvadmit_arrived_total"] == m["kvadmit_admitted_total"] + \
            m['kvadmit_rejected_total{reason="queue_full"}']
        assert m["kvadmit_finished_total"] == m["kvadmit_admitted_total"]
        assert m["kvadmit_waiting_requests"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
