"""One data-parallel rank of `vllm serve --data-parallel-size 2` failing closed takes the
whole server out (docs/trust-and-failure.md, "kvadmit's failed states"): vLLM's own
balancer cannot be told to skip a rank (DPLBAsyncMPClient scores each engine core by
its running and waiting requests, which a failed-closed core, refusing each request at
arrival, keeps at none, so it goes on drawing its share), and a router cannot address a
rank. So `/health` answers 503 failed-closed, `/get_load` a load no router picks,
`/v1/loads` the state; kvadmit's log line names the failed core (EngineCore_DP0).

The fault: the test-only plug-in of test_serve_fail_open.py, here in rank 0's engine
core only (KVADMIT_TEST_FAULT_RANK). Requests are pinned to a rank by vLLM's own
`X-data-parallel-rank` header, so each rank's outcome is known: rank 0's running
requests finish whole and its held ones get 503 kvadmit:failed_closed; rank 1 serves
every request, before and after; unpinned requests are still sent to rank 0 and refused;
no KV block stays in use at idle and the process stays up."""
import concurrent.futures

import httpx
from serving import free_port, running_server, serve_command
from test_serve_fail_open import (_completion, assert_the_server_shows_failed_closed,
                                  idle_metrics, write_fault_plugin)


def post(base, model, i, rank=None):
    """One completion (odd i: streaming), pinned to data-parallel `rank` unless None:
    (status, output tokens, max_tokens asked, body, Retry-After header)."""
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    status, got, want, r = _completion(base, model, i, headers)
    return status, got, want, r.text, r.headers.get("retry-after")


def wave(base, model, pinned):
    """`pinned` ([(i, rank)]) at once: their results, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(pinned)) as pool:
        return [f.result() for f in [pool.submit(post, base, model, i, rank)
                                     for i, rank in pinned]]


def refused_closed(result):
    status, _, _, text, retry_after = result
    return (status == 503 and "kvadmit:failed_closed" in text and "restarted" in text
            and retry_after is None)


def test_one_rank_failing_closed_takes_the_whole_server_out(model_dir, tmp_path):
    write_fault_plugin(tmp_path)
    prom = tmp_path / "prom"
    prom.mkdir()
    model = model_dir
    cmd = serve_command(model, free_port(), {"kvadmit": {"on_internal_error": "closed"}},
                        blocks=17, max_model_len=512, extra=("--data-parallel-size", "2"))
    env = {"PYTHONPATH": str(tmp_path), "KVADMIT_TEST_FAULT_AT_STEP": "20",
           "KVADMIT_TEST_FAULT_RANK": "0", "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    with running_server(cmd, tmp_path / "serve.log", env=env) as base:
        assert httpx.get(base + "/health", timeout=30).headers.get("x-kvadmit-state") == "ok"
        # 8 to rank 0 (4 run at a time: its step 20 comes with some held), 4 to rank 1
        results = wave(base, model, [(i, 0) for i in range(8)] + [(i, 1) for i in range(8, 12)])
        rank0, rank1 = results[:8], results[8:]
        assert all(r[0] == 200 and r[1] == r[2] for r in rank1), rank1
        served = [r for r in rank0 if r[0] == 200]
        refused = [r for r in rank0 if r[0] != 200]
        assert served and refused, rank0          # some were running, some held
        assert all(r[1] == r[2] for r in served), served
        assert all(refused_closed(r) for r in refused), refused
        log = (tmp_path / "serve.log").read_text()
        closing = [ln for ln in log.splitlines() if "failing closed" in ln]
        assert len(closing) == 1 and "EngineCore_DP0" in closing[0], closing or log[-3000:]

        # what a router sees: the whole server out
        assert_the_server_shows_failed_closed(base)     # both ranks' pools, counters
        loads = httpx.get(base + "/v1/loads", timeout=30).json()
        assert loads["kvadmit"]["state"] == "failed-closed", loads
        assert [r["token_usage"] for r in loads["loads"]] == [1.0], loads

        # rank 1 still serves what is sent to it, rank 0 refuses; vLLM's balancer
        # sends unpinned requests to rank 0 too (a router cannot steer them off it)
        after = wave(base, model, [(100, 1), (101, 1), (102, 0), (103, 0)])
        assert all(r[0] == 200 and r[1] == r[2] for r in after[:2]), after
        assert all(refused_closed(r) for r in after[2:]), after
        unpinned = wave(base, model, [(200 + i, None) for i in range(8)])
        assert any(refused_closed(r) for r in unpinned), unpinned
        assert all(refused_closed(r) or (r[0] == 200 and r[1] == r[2]) for r in unpinned)
        assert any(r[0] == 200 for r in unpinned), unpinned
        print("unpinned after the failure: %d of 8 refused"
              % sum(r[0] == 503 for r in unpinned))
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 200
        assert idle_metrics(base).get("vllm:kv_cache_usage_perc") == 0
