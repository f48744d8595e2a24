"""Starting `vllm serve` of the tiny model for the HTTP tests, and reading its /metrics."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def serve_command(model_dir, port, additional_config, scheduler_cls=None, extra=(),
                  tokenizer=False):
    """`vllm serve` of the tiny model through kvadmit's launcher, which also starts
    vLLM's CPU build (whose `vllm` command does not: kvadmit.vllm.serve) and adds
    `--scheduler-cls kvadmit.vllm.Scheduler` when `scheduler_cls` is None. Without
    `tokenizer`, token-id prompts only (--skip-tokenizer-init); with it, the tiny
    model's own tokenizer (text and chat too)."""
    return [sys.executable, "-m", "kvadmit.vllm.serve", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            *([] if tokenizer else ["--skip-tokenizer-init"]),
            "--dtype", "float32", "--block-size", "32", "--num-gpu-blocks-override", "24",
            "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager",
            "--gpu-memory-utilization", "0.3",
            *(["--scheduler-cls", scheduler_cls] if scheduler_cls else []),
            "--additional-config", json.dumps(additional_config), *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd, log, env=None, timeout=300):
    """Runs `cmd` (its output to `log`) until /health answers; yields the base URL;
    stops the server afterwards."""
    port = cmd[cmd.index("--port") + 1]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **(env or {})))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited: {log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"vllm serve did not come up in {timeout} s")
                time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def metrics(base) -> dict:
    """/metrics as {series: value}, summed over label sets that differ only in labels
    not named here (vLLM's engine and model labels)."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out = {}
    for ln in text.splitlines():
        if ln.startswith("#") or " " not in ln:
            continue
        name, value = ln.rsplit(" ", 1)
        if name.startswith("vllm:") and "{" in name:
            name = name.split("{")[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out
