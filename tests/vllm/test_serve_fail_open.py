"""kvadmit failing inside `vllm serve`'s engine core, under load, open (the default) or
closed (docs/trust-and-failure.md, "When kvadmit itself fails"). The fault is injected by
test-only code written here, on the server's PYTHONPATH (a vLLM plug-in, FAULT_PLUGIN),
that makes kvadmit's step raise at the step KVADMIT_TEST_FAULT_AT_STEP names (in the
engine core of the data-parallel rank KVADMIT_TEST_FAULT_RANK names, where set:
tests/vllm/test_serve_data_parallel_failure.py): environment variables only that code
reads.

Open: every request, streaming or not, then completes with its whole output and status
200; no KV block stays in use at idle; /get_load says failed-open and /metrics counts
the error once; the server serves a second wave.

Closed: every request that was running completes whole (200); every one kvadmit held
gets 503 kvadmit:failed_closed without Retry-After (a stream too, as its status, before
any byte of it); so does every new request; /health answers 503 failed-closed,
/get_load failed-closed with a load no router picks; KV usage is 0 at idle and the
process stays up."""
import concurrent.futures
import json
import time

import httpx
from serving import free_port, metrics, running_server, serve_command

# The fault, injected only by test code: a test-only vLLM general plug-in (an entry
# point of a distribution written on the server's PYTHONPATH, loaded by every vLLM
# process, the engine core before it builds its scheduler) makes kvadmit's step raise at
# the step KVADMIT_TEST_FAULT_AT_STEP names, beside kvadmit's own scheduler (a
# --scheduler-cls other than kvadmit's is refused where the kvadmit section is set:
# kvadmit.vllm.plugin.check_vllm_config).
FAULT_PLUGIN = '''
import os
from kvadmit.vllm.admission import VllmAdmission

AT = int(os.environ["KVADMIT_TEST_FAULT_AT_STEP"])
RANK = os.environ.get("KVADMIT_TEST_FAULT_RANK")     # unset: every engine core
_before_step, _calls = VllmAdmission.before_step, [0]


def rank(admission):
    """This engine core's data-parallel rank. vLLM resets data_parallel_rank to 0 in a
    dense model's ranks (each runs alone: reconfigure_for_independent_dp_rank);
    data_parallel_index keeps the rank."""
    parallel = admission._sched.vllm_config.parallel_config
    return getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)


def before_step(self, *args, **kwargs):
    if RANK is None or int(RANK) == rank(self):
        _calls[0] += 1
        if _calls[0] == AT:
            raise RuntimeError("injected fault")
    return _before_step(self, *args, **kwargs)


def install():
    if not getattr(VllmAdmission, "_test_fault", False):
        VllmAdmission.before_step, VllmAdmission._test_fault = before_step, True
'''


def write_fault_plugin(path):
    (path / "kvadmit_test_fault.py").write_text(FAULT_PLUGIN)
    info = path / "kvadmit_test_fault-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvadmit-test-fault\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvadmit_test_fault = kvadmit_test_fault:install\n")


def idle_metrics(base, wait_s=30):
    """The server's /metrics once nothing runs and no KV block is in use (or after
    `wait_s` seconds)."""
    for _ in range(wait_s):
        m = metrics(base)
        if m.get("vllm:kv_cache_usage_perc", 1) == 0 and m.get("vllm:num_requests_running") == 0:
            break
        time.sleep(1)
    return m


def test_a_fault_under_load_fails_open_and_nothing_is_lost(model_dir, tmp_path):
    write_fault_plugin(tmp_path)
    model = model_dir            # the served model's name is its path
    cmd = serve_command(model, free_port(), {}, blocks=17, max_model_len=512)
    env = {"PYTHONPATH": str(tmp_path), "KVADMIT_TEST_FAULT_AT_STEP": "20"}
    with running_server(cmd, tmp_path / "serve.log", env=env) as base:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:   # 12 at once, 4 run at a time
            futures = [pool.submit(_post, base, model, i) for i in range(12)]
            results = [f.result() for f in futures]
        assert all(status == 200 for status, _, _ in results), results
        assert all(got == want for _, got, want in results), results
        log = (tmp_path / "serve.log").read_text()
        assert log.count("failing open") == 1, log[-3000:]
        m = idle_metrics(base)
        assert m.get("vllm:kv_cache_usage_perc") == 0, m
        assert m.get("kvadmit_internal_errors_total") == 1, sorted(k for k in m if "kvadmit" in k)
        load = httpx.get(base + "/get_load", timeout=30).json()
        assert load["kvadmit"] == "failed-open" and load["source"] == "vllm", load
        with concurrent.futures.ThreadPoolExecutor(6) as pool:   # it serves on
            again = [f.result() for f in [pool.submit(_post, base, model, 100 + i)
                                          for i in range(6)]]
        assert all(status == 200 and got == want for status, got, want in again), again



def test_a_fault_under_load_fails_closed_refusing_the_held_and_finishing_the_running(
        model_dir, tmp_path):
    write_fault_plugin(tmp_path)
    model = model_dir
    cmd = serve_command(model, free_port(), {"kvadmit": {"on_internal_error": "closed"}},
                        blocks=17, max_model_len=512)
    env = {"PYTHONPATH": str(tmp_path), "KVADMIT_TEST_FAULT_AT_STEP": "20"}
    with running_server(cmd, tmp_path / "serve.log", env=env) as base:
        assert httpx.get(base + "/health", timeout=30).headers.get("x-kvadmit-state") == "ok"
        with concurrent.futures.ThreadPoolExecutor(12) as pool:   # 12 at once, 4 run at a time
            results = [f.result() for f in [pool.submit(_post, base, model, i, True)
                                            for i in range(12)]]
        served = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        assert served and refused, results          # some were running, some held
        assert all(got == want for _, got, want, _ in served), served
        for status, _, _, (text, retry_after) in refused:
            assert status == 503 and "kvadmit:failed_closed" in text, (status, text)
            assert "restarted" in text and retry_after is None, (text, retry_after)
        # streams too: the refusal is the response's status, before any byte of a stream
        assert any(i % 2 == 1 for i, r in enumerate(results) if r[0] == 503), results
        log = (tmp_path / "serve.log").read_text()
        assert log.count("failing closed") == 1, log[-3000:]
        assert_the_server_shows_failed_closed(base)
        # the process is up and answers; every new request is refused at once, named
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            again = [f.result() for f in [pool.submit(_post, base, model, 100 + i, True)
                                          for i in range(4)]]
        assert all(r[0] == 503 and "kvadmit:failed_closed" in r[3][0] for r in again), again
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 200
        assert metrics(base).get("vllm:kv_cache_usage_perc") == 0


def assert_the_server_shows_failed_closed(base):
    """What a router and an operator see once kvadmit failed closed: one internal error,
    the failed-closed gauge, /health 503 with the state header, /get_load a load no
    router picks; every KV block back at idle."""
    m = idle_metrics(base)
    assert m.get("vllm:kv_cache_usage_perc") == 0, m
    assert m.get("kvadmit_internal_errors_total") == 1, sorted(k for k in m if "kvadmit" in k)
    assert m.get("kvadmit_failed_closed") == 1, sorted(k for k in m if "kvadmit" in k)
    health = httpx.get(base + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["kvadmit"] == "failed-closed", health
    assert health.headers["x-kvadmit-state"] == "failed-closed"
    load = httpx.get(base + "/get_load", timeout=30).json()
    assert load["kvadmit"] == "failed-closed" and load["load"] >= 10**15, load


def _post(base, model, i, full=False):
    """One completion (odd i: streaming): (status, output tokens, max_tokens asked),
    and with ``full`` (an error's body, its Retry-After header)."""
    status, got, want, r = _completion(base, model, i)
    if not full:
        return status, got, want
    return status, got, want, (r.text, r.headers.get("retry-after"))


def _completion(base, model, i, headers=None):
    """One completion (odd i: streaming): (status, output tokens, max_tokens, response)."""
    stream = i % 2 == 1
    max_tokens = 24 + 9 * (i % 4)
    body = {"model": model, "prompt": [(i * 31 + k) % 900 + 3 for k in range(60 + 23 * (i % 5))],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    with httpx.Client(timeout=300) as c:
        r = c.post(base + "/v1/completions", json=body, headers=headers)
    if r.status_code != 200:
        return r.status_code, 0, max_tokens, r
    if not stream:
        return 200, r.json()["usage"]["completion_tokens"], max_tokens, r
    usage = [json.loads(line[6:]).get("usage") for line in r.text.splitlines()
             if line.startswith("data: {")]
    done = [u for u in usage if u]
    return 200, done[-1]["completion_tokens"] if done else 0, max_tokens, r
