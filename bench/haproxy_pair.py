"""Two `vllm serve` instances with kvadmit behind HAProxy, on this machine.

HAProxy balances round robin, retries a request another instance when one answers
503 (`retry-on 503` with `option redispatch`; HAProxy's `retry-on` cannot name 429,
kvadmit's default overload status, so both instances are configured with
`"overload_status": 503`),
and sets each server's weight from kvadmit's KV headroom through HAProxy's
agent-check protocol: a small agent per instance answers HAProxy's probe with
`<headroom as a share of the pool>%` read from the instance's `/metrics`
(`kvadmit_kv_headroom_blocks`). Needs `haproxy` (Debian's package) and vLLM's CPU
build; the tiny random-weight model is built if missing.

    python bench/haproxy_pair.py [--requests 12]

prints each request's answer and both instances' counters; the test
(tests/vllm/test_haproxy_pair.py) runs the same set-up.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvadmit.vllm.serve import launch_command, small_engine_flags

POOL_BLOCKS = 23        # --num-gpu-blocks-override 24, less vLLM's null block
# kvadmit's status for an overload refusal behind HAProxy: `retry-on` retries a 503 and
# cannot name a 429 (kvadmit's default), so the instances answer 503 explicitly.
OVERLOAD_STATUS = 503


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    out = {}
    for ln in text.splitlines():
        if ln.startswith(("kvadmit_", "vllm:kv_cache_usage_perc", "vllm:num_requests")) and " " in ln:
            name, value = ln.rsplit(" ", 1)
            out[name.split("{")[0] if name.startswith("vllm:") else name] = float(value)
    return out


def agent_reply(base: str) -> bytes:
    """HAProxy agent-check answer: the instance's KV headroom as a weight (1-100%)."""
    try:
        headroom = metrics(base).get("kvadmit_kv_headroom_blocks", POOL_BLOCKS)
    except OSError:
        return b"down\n"
    return f"{max(1, min(100, round(100 * headroom / POOL_BLOCKS)))}%\n".encode()


class Agent(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, base: str):
        self.base = base

        class Handler(socketserver.BaseRequestHandler):
            def handle(inner):
                inner.request.sendall(agent_reply(self.base))
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


HAPROXY_CFG = """global
    maxconn 256
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    retries 3
    option redispatch 1
    retry-on 503
    option http-buffer-request
listen llm
    bind 127.0.0.1:{port}
    balance roundrobin
{servers}
"""


class Pair:
    """Two kvadmit `vllm serve` instances (`caps[i]`: max_queued_requests, and
    `overload_status` 503, the status HAProxy's `retry-on 503` retries), their agents
    and HAProxy in front; a context manager (everything stops on exit)."""

    def __init__(self, model_dir: str, caps=(1, 6), workdir: str | None = None):
        self.model_dir = model_dir
        self.caps = caps
        self.dir = workdir or tempfile.mkdtemp(prefix="kvadmit-haproxy-")
        self.procs: list[subprocess.Popen] = []
        self.bases: list[str] = []
        self.agents: list[Agent] = []
        self.port = free_port()

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self):
        for i, cap in enumerate(self.caps):
            port = free_port()
            prom = os.path.join(self.dir, f"prom{i}")
            os.makedirs(prom, exist_ok=True)
            cmd = launch_command(self.model_dir, port, "--skip-tokenizer-init",
                                 *small_engine_flags(POOL_BLOCKS + 1, 512, 4), "--additional-config",
                                 json.dumps({"kvadmit": {"max_queued_requests": cap,
                                                         "overload_status": OVERLOAD_STATUS}}))
            log = open(os.path.join(self.dir, f"serve{i}.log"), "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=prom)))
            self.bases.append(f"http://127.0.0.1:{port}")
        deadline = time.time() + 300
        for i, base in enumerate(self.bases):
            while True:
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"instance {i} exited: see {self.dir}/serve{i}.log")
                if time.time() > deadline:
                    raise RuntimeError(f"instance {i}: no /health in 300 s")
                try:
                    urllib.request.urlopen(base + "/health", timeout=2)
                    break
                except OSError:
                    time.sleep(1)
        self.agents = [Agent(base) for base in self.bases]
        servers = "\n".join(
            f"    server s{i} {base[len('http://'):]} check agent-check agent-port "
            f"{agent.server_address[1]} agent-inter 500ms weight 100"
            for i, (base, agent) in enumerate(zip(self.bases, self.agents)))
        cfg = os.path.join(self.dir, "haproxy.cfg")
        with open(cfg, "w") as f:
            f.write(HAPROXY_CFG.format(port=self.port, servers=servers))
        log = open(os.path.join(self.dir, "haproxy.log"), "w")
        self.procs.append(subprocess.Popen([shutil.which("haproxy"), "-db", "-f", cfg],
                                           stdout=log, stderr=subprocess.STDOUT))
        for _ in range(50):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"haproxy did not answer: see {self.dir}/haproxy.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        for agent in self.agents:
            agent.shutdown()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def burst(url: str, model: str, n: int, tokens: int = 64) -> list[tuple]:
    """n completions at once through `url`: ("ok", tokens) or (status, message)."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    def one(i):
        prompt = [(i * 7919 + k) % 997 + 3 for k in range(60)]
        try:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                          temperature=0, extra_body={"ignore_eos": True})
            return ("ok", r.usage.completion_tokens)
        except openai.APIStatusError as e:
            return (e.status_code, str(e)[:200])
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--model-dir", help="the tiny model (built there if missing)")
    args = ap.parse_args()
    if shutil.which("haproxy") is None:
        print("haproxy_pair: needs haproxy (apt-get install haproxy)", file=sys.stderr)
        return 2
    from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
    model = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    with Pair(model) as pair:
        results = burst(pair.url, model, args.requests)
        for r in results:
            print(r)
        time.sleep(1.0)
        for i, base in enumerate(pair.bases):
            print(f"instance {i}: {json.dumps(metrics(base))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
