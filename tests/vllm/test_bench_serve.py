"""`vllm serve` of the tiny model with its own tokenizer (text, chat, and vLLM's own
`vllm bench serve --dataset-name random`), and a small `kvadmit bench serve` sweep
(two configs, two loads) checked through its JSON. Run under the engine lock."""
import json
import os
import pathlib
import statistics
import subprocess
import sys
import urllib.request

import pytest

from kvadmit.bench.serve.configs import parse_config
from kvadmit.bench.serve.server import Engine, Server

TRACE = pathlib.Path(__file__).resolve().parents[1] / "data" / "azure2023_conv_head200.csv"
FIRST_CPU = min(os.sched_getaffinity(0))     # the server's engine is bound to it


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """kvadmit's launcher with its scheduler, no --skip-tokenizer-init."""
    log = tmp_path_factory.mktemp("log") / "serve.log"
    s = Server(parse_config("kvadmit-default", 1, 1.0), model_dir,
               Engine(num_blocks=25, max_model_len=512, max_num_seqs=8), log,
               engine_cpus=(FIRST_CPU,))
    s.start()
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


def test_engine_cpus_bind_the_engine_processes_not_the_api_server(server):
    """engine_cpus: every thread of the engine core and its worker runs on FIRST_CPU
    only; the API server (the launcher's own process) keeps the machine's CPUs."""
    import psutil

    api = psutil.Process(server.proc.pid)
    children = api.children(recursive=True)
    assert any("EngineCore" in c.name() for c in children), [c.name() for c in children]
    assert server.bound and all("(" in n for n in server.bound)
    for child in children:
        for t in child.threads():
            assert os.sched_getaffinity(t.id) == {FIRST_CPU}, (child.name(), t.id)
    assert os.sched_getaffinity(server.proc.pid) == os.sched_getaffinity(0)


def test_text_and_chat_requests(server):
    r = post(server.base, "/v1/completions", {"model": server.model, "prompt": "w10 w11 hello",
                                               "max_tokens": 6, "ignore_eos": True})
    assert r["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                          "prompt_tokens_details": None, "completion_tokens_details": None}
    words = r["choices"][0]["text"].split()
    assert len(words) <= 6 and all(w.startswith("w") or w.startswith("<") for w in words), words
    r = post(server.base, "/v1/chat/completions", {
        "model": server.model, "max_tokens": 5, "ignore_eos": True,
        "messages": [{"role": "system", "content": "w7"}, {"role": "user", "content": "w8 w9"}]})
    # <s><|system|> w7 <|user|> w8 w9 <|assistant|>
    assert r["usage"]["prompt_tokens"] == 7 and r["usage"]["completion_tokens"] == 5
    assert r["choices"][0]["message"]["role"] == "assistant"


def test_the_stop_at_length_rides_on_vllm_xargs(server):
    r = post(server.base, "/v1/completions", {
        "model": server.model, "prompt": "w10 w11", "max_tokens": 40, "min_tokens": 6,
        "vllm_xargs": {"kvadmit_stop_at": 7}})
    assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "stop"


def test_vllm_bench_serve_random_runs_unchanged(server):
    """vLLM's own client, its random dataset, as its docs give it: TTFT/TPOT percentiles."""
    out = subprocess.run(
        [sys.executable, "-m", "kvadmit.cli", "bench", "serve", "client", "--base-url",
         server.base, "--model", server.model, "--dataset-name", "random",
         "--random-input-len", "48", "--random-output-len", "8", "--ignore-eos",
         "--num-prompts", "12", "--request-rate", "20", "--goodput", "ttft:5000", "tpot:500",
         "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for words in ("Successful requests:                     12", "Total input tokens:                      576",
                  "Total generated tokens:                  96", "P99 TTFT (ms):",
                  "P50 TPOT (ms):", "P99 TPOT (ms):", "Request goodput (req/s):"):
        assert words in text, text[-2000:]


def test_kvadmit_bench_serve_small_sweep(model_dir, tmp_path):
    """Two configs, two loads, two paired seeds, 24 trace requests each: each seed
    measures its own capacity on vllm-default and runs both configs back to back at it;
    the JSON's counts add up, every served request stopped at its real length,
    refusals are counted by reason and status, and each config's per-seed ratios to
    vllm-default are in the JSON and their medians on the terminal."""
    out = tmp_path / "serve.json"
    capped = 'kvadmit-cap2={"max_queued_requests": 2}'
    cmd = [sys.executable, "-m", "kvadmit.cli", "bench", "serve", "--trace", str(TRACE),
           "--requests", "24", "--load", "0.5", "2", "--seeds", "2",
           "--configs", "vllm-default", capped, "--num-blocks", "49", "--max-model-len", "1024",
           "--json", str(out), "--plot", str(tmp_path / "serve.png"), "--model-dir", model_dir,
           "--engine-cpus", str(FIRST_CPU)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    # vLLM's INFO logs go to the log file, not the terminal
    assert "INFO" not in p.stdout and "INFO" not in p.stderr, p.stdout + p.stderr[-2000:]
    assert "[8/8] seed 1 vllm-default" in p.stderr or "[8/8] seed 1 kvadmit-cap2" in p.stderr, p.stderr
    assert "seed 1: capacity" in p.stderr
    assert "every server has run the capacity burst once" in p.stderr     # none starts cold
    res = json.loads(out.read_text())
    log = pathlib.Path(res["log"])
    assert "Starting vLLM" in log.read_text() or "vLLM API server" in log.read_text()
    assert res["command"].startswith("kvadmit bench serve --trace")
    assert res["engine_cpus"] == [FIRST_CPU]
    assert res["machine"]["cpus"] >= 1 and res["machine"]["vllm"]
    (sec,) = res["sections"]
    assert sec["configs"] == ["vllm-default", "kvadmit-cap2"]
    cap = res["capacity_run"]
    assert cap["completed"] == 24 and cap["wrong_length"] == 0
    assert cap["output_tokens"] == sec["real_output_tokens"] > 24
    assert sec["capacity_rps"] == cap["request_throughput"] > 0
    rows = sec["rows"]
    assert sorted((r["seed"], r["config"], r["load"]) for r in rows) == [
        (s, c, x) for s in (0, 1) for c in ("kvadmit-cap2", "vllm-default") for x in (0.5, 2.0)]
    assert sorted(sec["capacity_by_seed"]) == ["0", "1"]
    assert sec["capacity_by_seed"]["0"] == sec["capacity_rps"]
    for r in rows:
        assert r["rate_rps"] == pytest.approx(r["load"] * sec["capacity_by_seed"][str(r["seed"])])
        assert r["completed"] + r["failed"] == r["requests"] == 24
        assert 0 <= r["good"] <= r["completed"] and r["goodput"] == r["good"] / 24
        assert r["wrong_length"] == 0, r          # every served request stopped at its length
        assert sum(r["failed_by_status"].values()) == r["failed"]
        assert r["preemptions"] >= 0
        # recompute, from the server's counters: vLLM's prompt counter takes each prompt
        # once, so the prefill less the bench scheduler's recomputed tokens is what was sent
        assert r["prefill_tokens"] > 0 and r["recomputed_tokens"] >= 0
        assert r["recompute_share"] == r["recomputed_tokens"] / r["prefill_tokens"]
        if r["failed"] == 0:
            assert r["output_tokens"] == sec["real_output_tokens"]
            assert r["prefill_tokens"] - r["recomputed_tokens"] == r["input_tokens"], r
            assert (r["recomputed_tokens"] > 0) == (r["preemptions"] > 0), r
        if r["config"] == "vllm-default":
            assert r["failed"] == 0 and r["refused_by_reason"] == {}
        else:
            # every kvadmit refusal is a failed request, 429 (the default
            # overload_status) before the stream or an error inside a 200 stream
            assert r["refused_by_reason"].get("queue_full", 0) == r["failed"], r
            assert set(r["failed_by_status"]) <= {"429", "200"}, r
    burst = [r for r in rows if r["config"] == "kvadmit-cap2" and r["load"] == 2.0]
    assert all(r["refused_by_reason"].get("queue_full", 0) > 0 for r in burst), burst  # cap 2
    assert len(sec["summary"]) == 4 and all(s["repeats"] == 2 for s in sec["summary"])
    for s in sec["summary"]:
        shares = [r["recompute_share"] for r in rows if (r["config"], r["load"]) == (s["config"], s["load"])]
        assert s["recompute_share"] == statistics.median(shares)
        goal = sec["goals"]["recompute_share"][s["config"]][f"{s['load']:g}"]
        assert goal == s["recompute_share"]
    assert "recompute %" in p.stdout, p.stdout
    # paired by seed: each config's ratio to vllm-default of the same seed
    by = {(r["config"], r["load"], r["seed"]): r for r in rows}
    assert [(e["config"], e["load"], e["seeds"]) for e in sec["paired"]] == [
        ("kvadmit-cap2", 0.5, [0, 1]), ("kvadmit-cap2", 2.0, [0, 1])]
    for e in sec["paired"]:
        assert e["output_tok_per_s"]["per_seed"] == [
            by["kvadmit-cap2", e["load"], s]["output_tok_per_s"] /
            by["vllm-default", e["load"], s]["output_tok_per_s"] for s in (0, 1)]
    assert "paired by seed, against vllm-default" in p.stdout
    assert (tmp_path / "serve.png").stat().st_size > 10_000

