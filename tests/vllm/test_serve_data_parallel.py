"""`vllm serve --data-parallel-size 2` on vLLM's CPU build with kvadmit: each data
parallel rank's engine core runs its own kvadmit scheduler over its own KV pool
(vLLM's front end balances requests between them); a burst beyond the ranks' queue
caps is refused with 429 (the default `overload_status`) + Retry-After, the rest is served, and the counters add up.
(Offline `LLM(data_parallel_size=2)` is not supported by vLLM in one process.)"""
import urllib.request

import pytest

from serving import free_port, running_server, serve_command
from test_serve import burst

openai = pytest.importorskip("openai")


def metrics(base):
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
            if (ln.startswith("kvadmit_") or ln.startswith("vllm:num_preemptions_total"))
            and " " in ln}


def test_two_data_parallel_ranks_each_run_kvadmit(model_dir, tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    cmd = serve_command(model_dir, free_port(), {"kvadmit": {"max_queued_requests": 2}},
                        extra=("--data-parallel-size", "2"))
    with running_server(cmd, tmp_path / "serve.log",
                        env={"PROMETHEUS_MULTIPROC_DIR": str(prom)}) as base:
        served, refused = burst(base, model_dir, 20, 64)
        assert served and all(n == 64 for _, n, _ in served), served
        assert refused, served      # 20 at once: more than 2 x (4 running + 2 queued)
        for status, msg, retry_after in refused:
            assert status == 429 and "kvadmit:queue_full" in msg and retry_after, (status, msg)
        # Two engine cores, each with kvadmit: both ranks report vLLM's series, and
        # kvadmit's counters (summed over the ranks' processes) add up to the burst.
        m = metrics(base)
        engines = {k for k in m if k.startswith("vllm:num_preemptions_total")}
        assert len(engines) == 2, engines
        assert m.get("kvadmit_admitted_total", 0) == len(served)
        assert m.get('kvadmit_rejected_total{reason="queue_full"}', 0) == len(refused)
