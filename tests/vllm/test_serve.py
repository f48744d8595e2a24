"""`vllm serve` with `--scheduler-cls kvadmit.vllm.Scheduler`, started by kvadmit's
launcher (`python -m kvadmit.vllm.serve`, which also starts vLLM's CPU build), driven
by the `openai` client over loopback: normal requests succeed, an overload burst beyond
kvadmit's queue cap gets HTTP 429 (the default `overload_status`) naming the reason, and `/metrics` (Prometheus
multiprocess mode) shows kvadmit's counters."""
import json
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving import free_port, metrics, running_server, serve_command

openai = pytest.importorskip("openai")


def burst(base, model, n, max_tokens):
    """n completions at once: the served ones as ("ok", tokens, None), the refused ones
    as (status, message, Retry-After header)."""
    def one(i):
        try:
            return ("ok", complete(base, model, 60, max_tokens, i).usage.completion_tokens, None)
        except openai.APIStatusError as e:
            return (e.status_code, str(e), e.response.headers.get("retry-after"))

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    return [r for r in results if r[0] == "ok"], [r for r in results if r[0] != "ok"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    prom = tmp_path_factory.mktemp("prom")
    log = tmp_path_factory.mktemp("log") / "serve.log"
    # slo_guard only acts on requests with a target (the defaults are none).
    cfg = {"kvadmit": {"policy": "peak", "max_queued_requests": 3, "slo_guard": True}}
    with running_server(serve_command(model_dir, free_port(), cfg), log,
                        env={"PROMETHEUS_MULTIPROC_DIR": str(prom)}) as base:
        yield base, model_dir, log


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def complete(base, model, prompt_len, max_tokens, seed, xargs=None):
    prompt = [(seed * 7919 + i) % 997 + 3 for i in range(prompt_len)]
    body = {"ignore_eos": True}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return client(base).completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, extra_body=body)


def test_normal_request_succeeds(server):
    base, model, _ = server
    r = complete(base, model, 40, 8, 0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 40


def test_overload_burst_gets_429_naming_the_reason(server):
    base, model, log = server
    ok, refused = burst(base, model, 16, 120)
    assert ok and all(n == 120 for _, n, _ in ok)
    assert refused, ok
    for status, msg, retry_after in refused:
        assert status == 429 and "kvadmit:queue_full" in msg, (status, msg)
        # the core's hint, from the drain rate, as a header (patches/vllm_retry_after.py)
        assert retry_after is not None and int(retry_after) >= 1, (msg, retry_after)
        assert f"(retry after {retry_after} s)" in msg
        # the numbers a client needs: the queue, the cap, the expected wait, its place
        for words in ("requests waiting", "max_queued_requests=3", "room expected in",
                      "in the retry line"):
            assert words in msg, msg
    # A refused burst is told to come back in line, not all after the same second.
    hints = sorted(int(r) for _, _, r in refused)
    assert len(refused) < 3 or len(set(hints)) > 1, hints


def test_metrics_show_kvadmit_counters(server):
    base, _, _ = server
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
             if ln.startswith("kvadmit_") and " " in ln}
    assert lines.get("kvadmit_admitted_total", 0) >= 1
    assert lines.get('kvadmit_rejected_total{reason="queue_full"}', 0) >= 1
    # Every reason and hold has its series; the step-time fit and agent window are gauges.
    for key in ('kvadmit_rejected_total{reason="slo_infeasible"}', 'kvadmit_held_total{reason="hold_slo"}',
                'kvadmit_held_total{reason="hold_agent"}', "kvadmit_agent_window"):
        assert key in lines, key
    fit = [v for k, v in lines.items() if k.startswith("kvadmit_step_time_per_token_seconds{")]
    assert fit and all(v > 0 for v in fit), fit
    assert "vllm:num_preemptions_total" in text


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
def test_orca_load_report_carries_kvadmits_signals(server, fmt):
    """`endpoint-load-metrics-format` on a request: vLLM's ORCA header, with
    kvadmit's router signals beside vLLM's own and application_utilization set to
    the admission pressure (patches/vllm_orca.py)."""
    base, model, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=model, prompt=list(range(3, 43)), max_tokens=4,
        extra_headers={"endpoint-load-metrics-format": fmt})
    value = raw.headers.get("endpoint-load-metrics")
    assert value and value.startswith(fmt + " "), value
    for name in ("kvadmit_kv_headroom_blocks", "kvadmit_admission_pressure",
                 "kvadmit_predicted_queue_delay_seconds", "kv_cache_usage_perc"):
        assert name in value, value
    assert "application_utilization" in value, value
    if fmt == "JSON":
        report = json.loads(value[len("JSON "):])
        assert 0.0 <= report["application_utilization"] == \
            report["named_metrics"]["kvadmit_admission_pressure"]
        assert report["named_metrics"]["kvadmit_kv_headroom_blocks"] <= 23


def test_request_fields_through_vllm_xargs(server):
    """kvadmit's per-request fields ride on vllm_xargs as flat kvadmit_* keys: a
    feasible target runs, an infeasible one is 429 slo_infeasible, a malformed one
    400 naming the field."""
    base, model, _ = server
    r = complete(base, model, 40, 4, 1, {"kvadmit_ttft_slo_s": 60, "kvadmit_session": "agent-1"})
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.APIStatusError) as e:
        complete(base, model, 40, 4, 2, {"kvadmit_ttft_slo_s": 1e-6})
    assert e.value.status_code == 429 and "kvadmit:slo_infeasible" in str(e.value)
    with pytest.raises(openai.APIStatusError) as e:
        complete(base, model, 40, 4, 3, {"kvadmit_ttft_slo_s": "soon"})
    assert e.value.status_code == 400 and "kvadmit_ttft_slo_s" in str(e.value), str(e.value)


def test_gie_slo_headers_become_kvadmits_fields(server):
    """x-slo-ttft-ms / x-slo-tpot-ms (the Gateway API Inference Extension's headers)
    reach kvadmit as the request's SLO fields (patches/vllm_slo_headers.py): an
    infeasible TTFT target is 429 slo_infeasible, a feasible one runs, the body's own
    field wins over the header, and a malformed header is a 400 naming the field."""
    base, model, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

    def ask(headers, xargs=None):
        return client.completions.create(model=model, prompt=list(range(5, 45)), max_tokens=4,
                                         extra_headers=headers,
                                         extra_body={"vllm_xargs": xargs} if xargs else None)

    with pytest.raises(openai.APIStatusError) as e:
        ask({"x-slo-ttft-ms": "0.001"})
    assert e.value.status_code == 429 and "kvadmit:slo_infeasible" in str(e.value)
    assert ask({"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "5000"}).usage.completion_tokens == 4
    assert ask({"x-slo-ttft-ms": "0.001"}, {"kvadmit_ttft_slo_s": 60}).usage.completion_tokens == 4
    with pytest.raises(openai.APIStatusError) as e:
        ask({"x-slo-tpot-ms": "soon"})
    assert e.value.status_code == 400 and "kvadmit_tpot_slo_s" in str(e.value)


def test_gie_fairness_header_becomes_kvadmits_flow(server):
    """x-gateway-inference-fairness-id (GIE's flow id) reaches kvadmit as the request's
    flow field: a flow id runs, an empty one is a 400 naming kvadmit_flow."""
    base, model, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

    def ask(flow):
        return client.completions.create(model=model, prompt=list(range(5, 45)), max_tokens=4,
                                         extra_headers={"x-gateway-inference-fairness-id": flow})

    assert ask("tenant-a").usage.completion_tokens == 4
    with pytest.raises(openai.APIStatusError) as e:
        ask("")
    assert e.value.status_code == 400 and "kvadmit_flow" in str(e.value)


@pytest.mark.parametrize("bad_id, words", [
    (1024, "prompt_token_ids[2]=1024: outside the model's vocabulary [0, 1024)"),
    (99999, "prompt_token_ids[2]=99999"),
])   # a negative id: the OpenAI server's own request validation answers 400
def test_out_of_vocabulary_prompt_gets_400_and_the_server_lives(server, bad_id, words):
    """--skip-tokenizer-init: vLLM does not check prompt ids; an id outside the
    vocabulary crashed the engine (IndexError) and with it the server. kvadmit refuses
    it at arrival: 400 naming the field and the limit; the server keeps serving."""
    base, model, _ = server
    invalid = 'kvadmit_rejected_total{reason="invalid"}'
    before = metrics(base).get(invalid, 0)
    with pytest.raises(openai.APIStatusError) as e:
        client(base).completions.create(model=model, prompt=[5, 6, bad_id], max_tokens=4)
    assert e.value.status_code == 400 and "kvadmit:invalid" in str(e.value), str(e.value)
    assert words in str(e.value), str(e.value)
    # Counted as the core's reason invalid, as SGLang counts it (issue 13 item 7).
    assert metrics(base).get(invalid, 0) == before + 1
    assert urllib.request.urlopen(base + "/health", timeout=10).status == 200
    assert complete(base, model, 20, 4, 9).usage.completion_tokens == 4


# Without kvadmit's start-up check these exit only once the engine core has loaded the
# weights and set up the KV cache (35-38 s here, minutes on a real model), and the
# last line is vLLM's "Engine core initialization failed. See root cause above."
ENGINE_LINES = ("(EngineCore", "Loading weights", "KV cache", "Engine core initialization")


def _serve_until_exit(cmd):
    """Runs `cmd` to its exit: (start time, when the API server logged its first line,
    i.e. its imports were done, the non-blank output lines, exit status)."""
    t0 = time.monotonic()
    up = None
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            if up is None and line.startswith("(APIServer"):
                up = time.monotonic()
            if line.strip():
                lines.append(line.rstrip())
        rc = p.wait(300)
    return t0, up, lines, rc


@pytest.mark.parametrize("additional_config, scheduler_cls, words", [
    ({"kvadmit": {"policy": "nonsense"}}, "kvadmit.vllm.Scheduler",
     "kvadmit config: policy='nonsense': must be one of"),
    ({"kvadmitt": {"policy": "peak", "max_queued_requests": 2}}, "kvadmit.vllm.Scheduler",
     "unknown key 'kvadmitt'; did you mean 'kvadmit'?"),
    ({"kvadmit": None}, "kvadmit.vllm.Scheduler", "'kvadmit' must be an object of kvadmit's keys, got null"),
    ({"kvadmit": {"max_queued_requests": 2}}, "vllm.v1.core.sched.scheduler.Scheduler",
     "add --scheduler-cls kvadmit.vllm.Scheduler"),
], ids=["bad-value", "typo", "null", "no-scheduler"])
def test_bad_config_exits_in_seconds_with_its_message_last(model_dir, additional_config,
                                                           scheduler_cls, words):
    """The API-server process checks kvadmit's settings when vLLM builds its config:
    the server exits before any engine process starts, the message naming the key last."""
    for _ in range(3):   # vLLM binds its port before building its config: a port taken
        t0, up, lines, rc = _serve_until_exit(       # meanwhile is another failure: retry
            serve_command(model_dir, free_port(), additional_config, scheduler_cls))
        if "Address already in use" not in lines[-1]:
            break
    end = time.monotonic()
    print(f"vllm serve with {additional_config}: exit {end - t0:.1f} s after start, "
          f"{end - (up or t0):.1f} s after the API server's first line")
    assert rc != 0
    assert words in lines[-1], lines[-5:]
    assert not [ln for ln in lines if any(e in ln for e in ENGINE_LINES)], lines[-20:]
    # No engine process started (above) is the proof; the times are loose bounds for a
    # shared machine. Measured here: 16-24 s from start, of which ~5 s after the API
    # server's first line (once 25 s under load); the rest is importing vLLM.
    assert up is not None and end - up < 30, end - up
    assert end - t0 < 90, end - t0


def test_max_tokens_over_the_context_is_cut_by_vllm(server):
    """What vLLM 0.32's OpenAI server does before kvadmit sees the request (docs/vllm.md):
    prompt + max_tokens over max_model_len answers 200 with max_tokens cut to the
    context left; max_tokens alone over max_model_len, or a prompt that fills the
    whole context, is vLLM's 400."""
    base, model, _ = server
    r = complete(base, model, 40, 500, 11)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 512 - 40
    for prompt_len, max_tokens in ((40, 600), (512, 4)):
        with pytest.raises(openai.APIStatusError) as e:
            complete(base, model, prompt_len, max_tokens, 12)
        assert e.value.status_code == 400 and "kvadmit" not in str(e.value), str(e.value)


def test_kvadmit_serve_is_the_launcher(model_dir):
    """`kvadmit serve` runs kvadmit.vllm.serve: here up to kvadmit's start-up check."""
    cmd = serve_command(model_dir, free_port(), {"kvadmit": {"policy": "nonsense"}})
    cmd[1:3] = ["-m", "kvadmit.cli", "serve"]
    for _ in range(3):
        _, _, lines, rc = _serve_until_exit(cmd)
        if "Address already in use" not in lines[-1]:
            break
        cmd[cmd.index("--port") + 1] = str(free_port())
    assert rc != 0 and "policy='nonsense'" in lines[-1], lines[-5:]
    assert "--scheduler-cls" not in cmd and "kvadmit.vllm.Scheduler" in "\n".join(lines)


def test_the_launcher_adds_kvadmits_scheduler_unless_one_is_named():
    from kvadmit.vllm.serve import serve_argv

    assert serve_argv(["M", "--port", "1"]) == ["vllm", "serve", "M", "--port", "1",
                                                "--scheduler-cls", "kvadmit.vllm.Scheduler"]
    assert serve_argv(["M", "--scheduler-cls", "x.Y"]) == ["vllm", "serve", "M", "--scheduler-cls", "x.Y"]
    assert serve_argv(["M", "--scheduler-cls=x.Y"])[-1] == "--scheduler-cls=x.Y"


def test_one_launch_command_for_the_tests_and_the_benches():
    """The tests' servers, `kvadmit bench serve`'s and the bench scripts' fleets all start
    `vllm serve` with kvadmit.vllm.serve.launch_command: this launcher, in this Python."""
    import sys

    from kvadmit.vllm.serve import launch_command, small_engine_flags

    assert launch_command("M", 8000, "--x", "1") == [
        sys.executable, "-m", "kvadmit.vllm.serve", "M", "--host", "127.0.0.1", "--port", "8000",
        "--x", "1"]
    flags = small_engine_flags(24, 512, 4)
    assert flags[flags.index("--num-gpu-blocks-override") + 1] == "24"
    assert serve_command("M", 8000, {})[:len(launch_command("M", 8000))] == \
        launch_command("M", 8000)


def rejected(m) -> float:
    return sum(v for k, v in m.items() if k.startswith("kvadmit_rejected_total{"))


def wait_idle(base, timeout=120) -> dict:
    """Waits until the engine runs and queues nothing (vLLM's gauges and kvadmit's)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base)
        if (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("kvadmit_waiting_requests", 0) == 0):
            return m
        assert time.time() < deadline, {k: v for k, v in m.items() if "num_requests" in k}
        time.sleep(0.5)


def assert_counters_add_up(m):
    """At idle every sequence that arrived was refused, finished or aborted (shed ones
    count as refused; invalid ones never reached the queue)."""
    ended = (sum(v for k, v in m.items() if k.startswith("kvadmit_rejected_total{")
                 and 'reason="invalid"' not in k)
             + m.get("kvadmit_finished_total", 0) + m.get("kvadmit_aborted_total", 0))
    assert m.get("kvadmit_arrived_total", 0) == ended, m


def load(base, model, n, max_tokens=120):
    """n long requests in the background (the caller joins the returned futures)."""
    pool = ThreadPoolExecutor(n)

    def one(i):
        try:
            return complete(base, model, 60, max_tokens, 100 + i).usage.completion_tokens
        except openai.APIStatusError as e:
            return e.status_code
    return pool, [pool.submit(one, i) for i in range(n)]


def sample(base, model, n, seed, max_tokens=8):
    prompt = [(seed * 31 + i) % 997 + 3 for i in range(40)]
    return client(base).completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                           n=n, temperature=1.0, seed=seed,
                                           extra_body={"ignore_eos": True})


def test_parallel_sampling_is_one_request(server):
    """n > 1 (issue 13 item 2): all samples run, or the request is refused as a whole
    (429 + Retry-After under load, 400 when n exceeds the queue cap), counted once."""
    base, model, _ = server
    wait_idle(base)
    r = sample(base, model, 3, 1)
    assert len(r.choices) == 3 and {c.finish_reason for c in r.choices} == {"length"}
    assert r.usage.completion_tokens == 3 * 8
    before = metrics(base)
    pool, futures = load(base, model, 5, max_tokens=400)   # 3 run (peak), 2 wait, long enough to see
    deadline = time.time() + 60
    while metrics(base).get("kvadmit_waiting_requests", 0) < 1:
        assert time.time() < deadline, "the load never queued"
        time.sleep(0.1)
    with pytest.raises(openai.APIStatusError) as e:
        sample(base, model, 3, 2)                   # 1 or 2 waiting + 3 > 3
    assert e.value.status_code == 429 and "kvadmit:queue_full" in str(e.value), str(e.value)
    assert int(e.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.APIStatusError) as e:
        sample(base, model, 4, 3)
    assert e.value.status_code == 400, str(e.value)
    assert "n=4 samples exceed max_queued_requests=3" in str(e.value)
    assert "retry-after" not in e.value.response.headers
    load_refused = sum(f.result() == 429 for f in futures)
    pool.shutdown()
    after = wait_idle(base)
    # Each n>1 request refused once, not per sample.
    assert rejected(after) - rejected(before) == 2 + load_refused
    assert_counters_add_up(after)


def test_a_streaming_refusal_logs_one_line(server):
    """A refusal inside a stream: the client gets vLLM's error event, the server log
    one line per refusal instead of a 9-line traceback (issue 13 item 6)."""
    base, model, log = server
    start = log.stat().st_size
    for seed in range(3):
        prompt = [(seed * 7 + i) % 997 + 3 for i in range(40)]
        with pytest.raises(openai.APIError) as e:
            for _ in client(base).completions.create(
                    model=model, prompt=prompt, max_tokens=4, stream=True,
                    extra_body={"vllm_xargs": {"kvadmit_ttft_slo_s": 1e-6}}):
                pass
        assert "kvadmit:slo_infeasible" in str(e.value), str(e.value)
    time.sleep(1)
    with open(log) as f:
        f.seek(start)
        new = f.read()
    assert "Traceback" not in new and "Error in completion stream generator" not in new, new
    lines = [ln for ln in new.splitlines() if "kvadmit:slo_infeasible" in ln]
    assert len(lines) == 3 and all("kvadmit refused a streaming request" in ln for ln in lines), new


def test_overload_soak_leaves_nothing_behind(server):
    """A bounded burst of mixed streaming, non-streaming, n=2 and cancelled requests;
    then, at idle, every KV block is free, nothing waits, and the counters add up."""
    base, model, _ = server
    before = wait_idle(base)

    def plain(i):
        try:
            return ("ok", complete(base, model, 30 + i, 24, 200 + i).usage.completion_tokens)
        except openai.APIStatusError as e:
            return (e.status_code, 0)

    def streamed(i):
        try:
            chunks = list(client(base).completions.create(
                model=model, prompt=[(i * 13 + j) % 997 + 3 for j in range(30)], max_tokens=16,
                stream=True, extra_body={"ignore_eos": True}))
            return ("ok", sum(len(c.choices[0].text) >= 0 for c in chunks if c.choices))
        except openai.APIError as e:
            return ("refused" if "kvadmit:" in str(e) else repr(e), 0)

    def pair(i):
        try:
            return ("ok", sample(base, model, 2, 300 + i, max_tokens=12).usage.completion_tokens)
        except openai.APIStatusError as e:
            return (e.status_code, 0)

    def cancelled(i):
        try:
            stream = client(base).completions.create(
                model=model, prompt=[(i * 17 + j) % 997 + 3 for j in range(50)], max_tokens=200,
                stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                break                                   # the client goes away mid-answer
            stream.close()
            return ("cancelled", 0)
        except openai.APIError as e:
            return ("refused" if "kvadmit:" in str(e) else repr(e), 0)

    # Three cancellations a moment ahead of the burst (so they run before they go away),
    # then the burst with three more.
    kinds = [cancelled] * 3 + [plain] * 8 + [streamed] * 6 + [pair] * 4 + [cancelled] * 3
    with ThreadPoolExecutor(len(kinds)) as pool:
        futures = []
        for i, kind in enumerate(kinds):
            futures.append(pool.submit(kind, i))
            if i == 2:
                time.sleep(0.5)
        results = [f.result() for f in futures]
    outcomes = {r[0] for r in results}
    assert outcomes <= {"ok", "cancelled", "refused", 429}, results
    assert {"ok", "cancelled"} <= outcomes and ({"refused", 429} & outcomes), results
    after = wait_idle(base)
    assert after.get("vllm:kv_cache_usage_perc", 1) == 0, after
    assert after.get("kvadmit_waiting_requests", 1) == 0
    assert_counters_add_up(after)
    n_refused = sum(r[0] in ("refused", 429) for r in results)
    assert rejected(after) - rejected(before) >= n_refused
    ok_sequences = sum(2 if k is pair else 1 for (o, _), k in zip(results, kinds) if o == "ok")
    assert after["kvadmit_finished_total"] - before.get("kvadmit_finished_total", 0) >= ok_sequences
    # A client that went away mid-answer is an abort (the core's count, exported).
    n_cancelled = sum(r[0] == "cancelled" for r in results)
    assert (after.get("kvadmit_aborted_total", 0) - before.get("kvadmit_aborted_total", 0)
            >= n_cancelled), results


def start_long_request(base, model, pool, seed):
    """A 40-token prompt generating 460 tokens (16 of the 24 blocks, about 1 s here),
    submitted to `pool`, once vLLM runs it."""
    long = pool.submit(complete, base, model, 40, 460, seed)
    deadline = time.time() + 60
    while metrics(base).get("vllm:num_requests_running", 0) < 1:
        assert time.time() < deadline and not long.done()
        time.sleep(0.05)
    return long


def test_stale_and_abandoned_requests_never_reach_prefill(server):
    """Issue 22 item 4 over HTTP: while a long request holds the pool, a request held
    behind it with llm-d's TTL header (200 ms) is refused as `expired` (400, not
    retryable) once its TTL passes, and one whose client disconnects while it is held
    is aborted; neither is ever prefilled (vLLM's prompt-token counter grows by the
    long request's prompt alone), and the counters add up at idle. (The long request
    runs about 1 s here; both held ones end within 0.5 s of its start.)"""
    import httpx
    base, model, _ = server
    before = wait_idle(base)
    pool = ThreadPoolExecutor(3)
    long = start_long_request(base, model, pool, 900)   # 16 of the 24 blocks
    body = {"model": model, "prompt": [(i * 5) % 997 + 3 for i in range(40)], "max_tokens": 440,
            "ignore_eos": True}                     # 15 blocks: the peak rule holds it

    def stale():
        t0 = time.time()
        r = httpx.post(base + "/v1/completions", json=body, timeout=60,
                       headers={"x-llm-d-inference-ttl": "200ms"})
        return r, time.time() - t0, long.done()

    def abandoned():
        try:                                        # held: nothing comes; the client leaves
            with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                              timeout=httpx.Timeout(60, read=0.3)) as s:
                for _ in s.iter_bytes():
                    pass
        except httpx.ReadTimeout:
            return "left", long.done()
        return "served", long.done()

    stale_f, abandoned_f = pool.submit(stale), pool.submit(abandoned)
    r, waited, long_done = stale_f.result()
    assert r.status_code == 400 and "kvadmit:expired" in r.text and "ttl_s=0.2 s" in r.text, \
        (r.text, waited, long_done)
    assert 0.2 <= waited < 10 and not long_done
    assert abandoned_f.result() == ("left", False)
    assert long.result().usage.completion_tokens == 460
    after = wait_idle(base)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 40
    assert after['kvadmit_rejected_total{reason="expired"}'] - \
        before.get('kvadmit_rejected_total{reason="expired"}', 0) == 1
    assert after["kvadmit_aborted_total"] - before.get("kvadmit_aborted_total", 0) == 1
    assert_counters_add_up(after)


def test_sheddable_requests_are_refused_while_another_waits_for_kv(server):
    """Issue 22 item 3 over HTTP: while a long request holds the pool and another
    waits behind it, a request marked `x-kvadmit-sheddable: true` is refused at once
    with 429, Retry-After and kvadmit:shed, as a plain response and as a stream, and
    never prefilled; the waiting request runs when the long one ends."""
    import httpx
    base, model, _ = server
    before = wait_idle(base)
    pool = ThreadPoolExecutor(2)
    long = start_long_request(base, model, pool, 901)   # 16 of the 24 blocks
    deadline = time.time() + 60
    held = pool.submit(complete, base, model, 40, 440, 902)   # 15 blocks: held
    while metrics(base).get("kvadmit_waiting_requests", 0) < 1:
        assert time.time() < deadline and not long.done()
        time.sleep(0.05)
    time.sleep(0.2)                                   # a few steps: its hold is seen
    body = {"model": model, "prompt": [(i * 3) % 997 + 3 for i in range(40)], "max_tokens": 8}
    headers = {"x-kvadmit-sheddable": "true"}
    r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 429 and "kvadmit:shed" in r.text and "sheddable" in r.text, r.text
    assert float(r.headers["retry-after"]) >= 1
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                      headers=headers, timeout=60) as s:
        assert s.status_code == 429 and "retry-after" in s.headers
        assert "kvadmit:shed" in s.read().decode()
    assert not long.done()
    assert long.result().usage.completion_tokens == 460
    assert held.result().usage.completion_tokens == 440
    after = wait_idle(base)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 80
    assert after['kvadmit_rejected_total{reason="shed"}'] - \
        before.get('kvadmit_rejected_total{reason="shed"}', 0) == 2
    assert_counters_add_up(after)
