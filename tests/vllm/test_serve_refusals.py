"""Refusals on `vllm serve` as a streaming client meets them (issue 19): a refused
stream (/v1/completions and /v1/chat/completions, n = 1 and 2) is an HTTP status
before the first byte, the same status, body and
Retry-After as the same request without streaming; an admitted stream is
unchanged; the overload status is the config's (429 here); `GET /get_load`
answers from kvadmit's state and `vllm:num_requests_waiting` counts the requests
kvadmit holds.

The server: policy peak on a pool of 34 blocks of 32 tokens. A filler of 40 + 1000
tokens ends on 33 of them; a long request of 40 + 1020 tokens (34 blocks alone) would
still run when the filler ends, needing at least 2 blocks beside its 33, so it waits for
the whole filler however far the filler has got (peak counts every request's growth);
at most 2 waiting requests; a backlog of at most 300 prompt tokens; priority
scheduling with shedding.

Refusal reasons over HTTP: invalid, queued_tokens_full (final and retryable),
slo_infeasible, queue_full and shed are answered here; context_length and
kv_capacity are not reachable through vLLM 0.32's OpenAI server, which cuts
max_tokens to the context and refuses a prompt over max_model_len itself (see
test_serve.py); their mapping is the same code (kvadmit.protocol, tested for
every reason in tests/vllm/test_patches.py).
"""
import json
import threading
import time
import urllib.request

import httpx
import pytest
from serving import free_port, metrics, running_server, serve_command

openai = pytest.importorskip("openai")

CONFIG = {"kvadmit": {"policy": "peak", "max_queued_requests": 2, "max_queued_tokens": 300,
                      "slo_guard": True, "shed_lower_priority": True, "overload_status": 429}}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    cmd = serve_command(model_dir, free_port(), CONFIG, tokenizer=True, blocks=35,
                        max_model_len=1088, extra=("--scheduling-policy", "priority"))
    # No PROMETHEUS_MULTIPROC_DIR: kvadmit's launcher turns multiprocess mode on.
    with running_server(cmd, log) as base:
        yield base, model_dir


# A long request waits for the whole filler, not for a part of it that a fast machine
# runs through before the test looks: it would outlast the filler (see the docstring).
FILL = 1000    # 40 + 1000 tokens: 33 of the pool's 34 blocks at its end
LONG = 1020    # 40 + 1020 tokens: the whole pool alone


def prompt(seed, n=40):
    return [(seed * 7919 + i) % 997 + 3 for i in range(n)]


def body(model, seed, stream, n_tokens=4, n=1, prompt_len=40, priority=0, xargs=None,
         ignore_eos=True):
    b = {"model": model, "prompt": prompt(seed, prompt_len), "max_tokens": n_tokens,
         "temperature": 0.8 if n > 1 else 0, "n": n, "stream": stream, "priority": priority,
         "ignore_eos": ignore_eos}
    if xargs:
        b["vllm_xargs"] = xargs
    return b


def post(base, payload, timeout=120, route="/v1/completions"):
    """One request over HTTP: (status, headers, the whole body as text)."""
    with httpx.Client(timeout=timeout) as c:
        r = c.post(base + route, json=payload)
        return r.status_code, r.headers, r.text


def chat(model, stream, n=1, xargs=None):
    b = {"model": model, "messages": [{"role": "user", "content": "w10 w11 w12 w13"}],
         "max_tokens": 4, "n": n, "stream": stream, "temperature": 0.8 if n > 1 else 0,
         "ignore_eos": True}
    if xargs:
        b["vllm_xargs"] = xargs
    return b


def error_of(text):
    return json.loads(text)["error"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case, xargs, prompt_len, status, reason", [
    ("invalid", {"kvadmit_ttft_slo_s": "soon"}, 40, 400, "invalid"),
    ("prompt-over-backlog-cap", None, 320, 400, "queued_tokens_full"),
    ("slo-infeasible", {"kvadmit_ttft_slo_s": 1e-6}, 40, 429, "slo_infeasible"),
])
def test_a_refused_stream_is_the_same_http_error_as_without_streaming(server, n, case, xargs,
                                                                      prompt_len, status, reason):
    base, model = server
    plain = post(base, body(model, 1, False, n=n, prompt_len=prompt_len, xargs=xargs))
    streamed = post(base, body(model, 1, True, n=n, prompt_len=prompt_len, xargs=xargs))
    for got_status, headers, text in (plain, streamed):
        assert got_status == status, (case, got_status, text)
        assert "text/event-stream" not in headers.get("content-type", ""), headers
        err = error_of(text)
        assert err["code"] == status and err["message"].startswith(f"kvadmit:{reason}:"), err
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert f"(retry after {headers['retry-after']} s)" in err["message"]
            # the same hint as a number in the body, for a router that drops headers
            assert err["retry_after_s"] == int(headers["retry-after"]), err
        else:
            assert "retry-after" not in headers and "(retrying will not help)" in err["message"]
            assert "retry_after_s" not in err, err
    if status == 400:   # the same words (a retryable one's numbers move with time)
        assert error_of(plain[2]) == error_of(streamed[2])
    assert error_of(plain[2])["type"] == error_of(streamed[2])["type"]


def test_the_openai_streaming_client_sees_the_status(server):
    """The OpenAI SDK in streaming mode raises the status error (with Retry-After in
    its response) where it used to iterate a 200 stream into an error event."""
    base, model = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=model, prompt=prompt(3), max_tokens=4, stream=True,
                                  extra_body={"vllm_xargs": {"kvadmit_ttft_slo_s": 1e-6}})
    assert e.value.status_code == 429 and "kvadmit:slo_infeasible" in str(e.value)
    assert int(e.value.response.headers["retry-after"]) >= 1
    # the SDK's error body (the "error" object) has the hint as a number
    assert e.value.body["retry_after_s"] == int(e.value.response.headers["retry-after"])


def test_an_admitted_stream_is_unchanged(server):
    """Its tokens, one finish reason, [DONE] last, the usage counted (under load vLLM
    may put several tokens in one event, so events are not counted)."""
    base, model = server
    payload = body(model, 5, True, n_tokens=12)
    payload["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", base + "/v1/completions",
                                                  json=payload) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert len(chunks) >= 2 and "w" in "".join(ch.get("text", "") for c in chunks
                                                 for ch in c["choices"])


@pytest.mark.parametrize("n", [1, 2])
def test_a_refused_chat_stream_is_the_same_http_error_as_without_streaming(server, n):
    base, model = server
    for xargs, status, reason in (({"kvadmit_ttft_slo_s": 1e-6}, 429, "slo_infeasible"),
                                  ({"kvadmit_ttft_slo_s": "soon"}, 400, "invalid")):
        plain = post(base, chat(model, False, n, xargs), route="/v1/chat/completions")
        streamed = post(base, chat(model, True, n, xargs), route="/v1/chat/completions")
        for got, headers, text in (plain, streamed):
            assert got == status and "text/event-stream" not in headers.get("content-type", "")
            assert error_of(text)["message"].startswith(f"kvadmit:{reason}:"), text
            assert ("retry-after" in headers) == (status == 429)
        assert error_of(plain[2])["type"] == error_of(streamed[2])["type"]


def test_an_admitted_chat_stream_works(server):
    base, model = server
    with httpx.Client(timeout=120) as c, c.stream("POST", base + "/v1/chat/completions",
                                                  json=chat(model, True)) as r:
        assert r.status_code == 200
        events = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])["choices"][0]["delta"]
    assert first.get("role") == "assistant"


def test_waiting_streams_refused_for_a_full_queue_or_shed_get_a_status(server):
    """A long request fills the pool; two streams wait (the queue's cap); a third of
    the same priority is refused queue_full, and one of higher priority sheds a
    waiting stream: each refused before its first byte, 429 with Retry-After. While
    they wait, /get_load reports kvadmit's state and vLLM's waiting gauge counts them."""
    base, model = server
    idle = json.loads(urllib.request.urlopen(base + "/get_load", timeout=10).read())
    assert idle["source"] == "kvadmit" and idle["waiting"] == 0, idle
    results = {}
    filler_running, filler_done = threading.Event(), threading.Event()

    def run(name, payload):
        results[name] = post(base, payload, timeout=300)

    def run_filler():
        # Streamed, so the others are sent once it runs (its first byte is back).
        with httpx.Client(timeout=300) as c, c.stream("POST", base + "/v1/completions",
                                                      json=body(model, 10, True,
                                                                n_tokens=FILL)) as r:
            lines = []
            for ln in r.iter_lines():
                lines.append(ln)
                filler_running.set()
            results["filler"] = r.status_code, r.headers, "\n".join(lines)
        filler_running.set()
        filler_done.set()

    threads = [threading.Thread(target=run_filler)]
    threads[0].start()
    assert filler_running.wait(120) and not filler_done.is_set(), results.get("filler")
    for name in ("low-1", "low-2"):
        threads.append(threading.Thread(target=run, args=(name, body(
            model, 11 + len(threads), True, n_tokens=LONG, priority=10))))
        threads[-1].start()
    # Both held: kvadmit's queue and vLLM's waiting gauge agree, and /get_load reads it.
    deadline = time.time() + 30
    while time.time() < deadline and not filler_done.is_set():
        m = metrics(base)
        if m.get("kvadmit_waiting_requests") == 2:
            break
        time.sleep(0.2)
    assert m.get("kvadmit_waiting_requests") == 2, (filler_done.is_set(), m)
    assert m.get("vllm:num_requests_waiting") == 2, m
    busy = json.loads(urllib.request.urlopen(base + "/get_load", timeout=10).read())
    assert busy["waiting"] == 2 and busy["load"] > idle["load"], (idle, busy)

    same = post(base, body(model, 20, True, priority=10))
    assert same[0] == 429 and error_of(same[2])["message"].startswith("kvadmit:queue_full:"), same
    assert int(same[1]["retry-after"]) >= 1

    threads.append(threading.Thread(target=run, args=("high", body(model, 21, True, n_tokens=LONG,
                                                                  priority=0))))
    threads[-1].start()
    for t in threads:
        t.join(300)
    shed = [results[k] for k in ("low-1", "low-2") if results[k][0] != 200]
    assert len(shed) == 1, {k: v[0] for k, v in results.items()}
    status, headers, text = shed[0]
    assert status == 429 and error_of(text)["message"].startswith("kvadmit:shed:"), shed
    assert int(headers["retry-after"]) >= 1
    for name in ("filler", "high"):
        assert results[name][0] == 200 and results[name][2].rstrip().endswith("data: [DONE]")
