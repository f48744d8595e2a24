"""Starting `vllm serve` of the tiny model for the HTTP tests, and reading its /metrics."""
import contextlib
import json
import os
import subprocess
import time
import urllib.request

import pytest

# one /metrics reader and port picker for the tests and `kvadmit bench serve`
from kvadmit.bench.serve.server import free_port, scrape_metrics as metrics  # noqa: F401
from kvadmit.vllm.serve import launch_command, small_engine_flags


def serve_command(model_dir, port, additional_config, scheduler_cls=None, extra=(),
                  tokenizer=False, blocks=24, max_model_len=512):
    """`vllm serve` of the tiny model through kvadmit's launcher, which also starts
    vLLM's CPU build (whose `vllm` command does not: kvadmit.vllm.serve) and adds
    `--scheduler-cls kvadmit.vllm.Scheduler` when `scheduler_cls` is None. Without
    `tokenizer`, token-id prompts only (--skip-tokenizer-init); with it, the tiny
    model's own tokenizer (text and chat too). The pool: `blocks` of 32 tokens (one
    of them vLLM's null block)."""
    return launch_command(model_dir, port, *([] if tokenizer else ["--skip-tokenizer-init"]),
                          *small_engine_flags(blocks, max_model_len, 4),
                          *(["--scheduler-cls", scheduler_cls] if scheduler_cls else []),
                          "--additional-config", json.dumps(additional_config), *extra)


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
