"""kvadmit failing inside `vllm serve`'s engine core, under load: it fails open (docs/vllm.md,
"When kvadmit itself fails"). The fault is injected by a test-only scheduler module
(written here, on the server's PYTHONPATH, named by --scheduler-cls) that makes kvadmit's
step raise at the step KVADMIT_TEST_FAULT_AT_STEP names: an environment variable only
this test's module reads. Every request, streaming or not, then completes with its
whole output and status 200; no KV block stays in use at idle; /get_load says
failed-open and /metrics counts the error once; the server serves a second wave."""
import concurrent.futures
import json
import time

import httpx
from serving import free_port, metrics, running_server, serve_command

FAULTY = '''
import os
from kvadmit.vllm.admission import VllmAdmission
from kvadmit.vllm.scheduler import Scheduler

AT = int(os.environ["KVADMIT_TEST_FAULT_AT_STEP"])
_before_step, _calls = VllmAdmission.before_step, [0]


def before_step(self, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] == AT:
        raise RuntimeError("injected fault")
    return _before_step(self, *args, **kwargs)


VllmAdmission.before_step = before_step


class FaultyScheduler(Scheduler):
    """kvadmit's scheduler, with the fault above."""
'''


def test_a_fault_under_load_fails_open_and_nothing_is_lost(model_dir, tmp_path):
    (tmp_path / "faulty_scheduler.py").write_text(FAULTY)
    model = model_dir            # the served model's name is its path
    cmd = serve_command(model, free_port(), {}, scheduler_cls="faulty_scheduler.FaultyScheduler",
                        blocks=17, max_model_len=512)
    env = {"PYTHONPATH": str(tmp_path), "KVADMIT_TEST_FAULT_AT_STEP": "20"}
    with running_server(cmd, tmp_path / "serve.log", env=env) as base:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:   # 12 at once, 4 run at a time
            futures = [pool.submit(_post, base, model, i) for i in range(12)]
            results = [f.result() for f in futures]
        assert all(status == 200 for status, _, _ in results), results
        assert all(got == want for _, got, want in results), results
        log = (tmp_path / "serve.log").read_text()
        assert log.count("failing open") == 1, log[-3000:]
        for _ in range(30):
            m = metrics(base)
            if m.get("vllm:kv_cache_usage_perc", 1) == 0 and m.get("vllm:num_requests_running") == 0:
                break
            time.sleep(1)
        assert m.get("vllm:kv_cache_usage_perc") == 0, m
        assert m.get("kvadmit_internal_errors_total") == 1, sorted(k for k in m if "kvadmit" in k)
        load = httpx.get(base + "/get_load", timeout=30).json()
        assert load["kvadmit"] == "failed-open" and load["source"] == "vllm", load
        with concurrent.futures.ThreadPoolExecutor(6) as pool:   # it serves on
            again = [f.result() for f in [pool.submit(_post, base, model, 100 + i)
                                          for i in range(6)]]
        assert all(status == 200 and got == want for status, got, want in again), again


def _post(base, model, i):
    """One completion (odd i: streaming): (status, output tokens, max_tokens asked)."""
    stream = i % 2 == 1
    max_tokens = 24 + 9 * (i % 4)
    body = {"model": model, "prompt": [(i * 31 + k) % 900 + 3 for k in range(60 + 23 * (i % 5))],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    with httpx.Client(timeout=300) as c:
        r = c.post(base + "/v1/completions", json=body)
    if r.status_code != 200:
        return r.status_code, 0, max_tokens
    if not stream:
        return 200, r.json()["usage"]["completion_tokens"], max_tokens
    usage = [json.loads(line[6:]).get("usage") for line in r.text.splitlines()
             if line.startswith("data: {")]
    done = [u for u in usage if u]
    return 200, done[-1]["completion_tokens"] if done else 0, max_tokens
