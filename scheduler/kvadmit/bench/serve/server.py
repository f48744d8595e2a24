"""The servers of `kvadmit bench serve`: one `vllm serve` of the tiny model per config,
started by kvadmit's launcher (kvadmit.vllm.serve), its engine optionally bound to
given CPUs, and its /metrics."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from kvadmit.bench.serve.configs import ServeConfig
from kvadmit.vllm.serve import launch_command, small_engine_flags

STOP_AT_PROCESSOR = "kvadmit.bench.vllm:StopAtLength"


@dataclass(frozen=True)
class Engine:
    num_blocks: int = 49           # --num-gpu-blocks-override (one is vLLM's null block)
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048

    def flags(self) -> list[str]:
        return [*small_engine_flags(self.num_blocks, self.max_model_len, self.max_num_seqs,
                                    self.block_size),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens), "--seed", "0",
                "--no-enable-prefix-caching", "--logits-processors", STOP_AT_PROCESSOR]


def scrape_metrics(base: str, timeout: float = 30) -> dict[str, float]:
    """A server's /metrics: vLLM's series summed over their labels, kvadmit's by full name."""
    text = urllib.request.urlopen(base + "/metrics", timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith("#") or " " not in ln:
            continue
        name, value = ln.rsplit(" ", 1)
        if name.startswith("vllm:") and "{" in name:
            name = name.split("{")[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_engine(pid: int, cpus: set[int]) -> list[str]:
    """Binds every thread of the processes under the server `pid` (vLLM's engine core
    and its worker, not the API server itself) to `cpus`; returns those processes'
    names. On a small CPU machine vLLM's CPU build binds its worker to one core and
    leaves the engine core, which spins while it waits for each step, on the core the
    API server and the benchmark's client run on: they then stall for seconds and the
    measured TTFT is theirs. Bound beside its worker, the engine core's scheduling no
    longer overlaps the worker's step: the front end's delays go, and so does part of
    the engine's throughput (on the 2-core dev VM the online bench's capacity fell
    from 30 to 16 requests a second)."""
    import psutil   # a dependency of vLLM

    names = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            for thread in child.threads():
                os.sched_setaffinity(thread.id, cpus)
            names.append(f"{child.name()}({child.pid})")
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass      # a helper that exited meanwhile
    return names


@dataclass
class Server:
    config: ServeConfig
    model: str
    engine: Engine
    log: pathlib.Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    prom: tempfile.TemporaryDirectory | None = None
    env: dict[str, str] = field(default_factory=dict)   # more environment for the server
    engine_cpus: tuple[int, ...] = ()   # once up, the engine's processes bound to these (bind_engine)
    bound: list[str] = field(default_factory=list)      # the processes bound

    def __post_init__(self):
        usable = os.sched_getaffinity(0)
        bad = [c for c in self.engine_cpus if c not in usable]
        if bad:
            raise ValueError(f"engine_cpus={list(self.engine_cpus)}: CPU {bad[0]} is not one "
                             f"this process may run on ({sorted(usable)})")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return launch_command(self.model, self.port, *self.engine.flags(), *self.config.flags)

    def start(self) -> None:
        # kvadmit's counters live in the engine process: Prometheus multiprocess mode
        self.prom = tempfile.TemporaryDirectory(prefix="kvadmit-prom-")
        env = dict(os.environ, **self.env, PROMETHEUS_MULTIPROC_DIR=self.prom.name)
        with open(self.log, "a") as f:
            f.write(f"\n===== {self.config.label}: {' '.join(self.command())}\n")
            f.flush()
            self.proc = subprocess.Popen(self.command(), stdout=f, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve ({self.config.label}) exited with "
                                   f"{self.proc.returncode}; see {self.log}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
            except OSError:      # not answering yet
                time.sleep(1)
                continue
            # outside the try: a failed binding is an error, not "not up yet"
            if self.engine_cpus:
                self.bound = bind_engine(self.proc.pid, set(self.engine_cpus))
            return
        raise RuntimeError(f"vllm serve ({self.config.label}) not up in {timeout:.0f} s; "
                           f"see {self.log}")

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.base)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.prom is not None:
            self.prom.cleanup()
