"""What `kvadmit bench vllm` adds inside vLLM's engine: the schedulers that hold a
burst and count scheduled tokens (and time steps); the logits processor that stops a
request at its real length is kvadmit.bench.vllm.stop_at. vLLM loads them by name
(`kvadmit.bench.vllm.CountingScheduler`, `kvadmit.bench.vllm:StopAtLength`; the package
re-exports them)."""
from __future__ import annotations

import os
import pathlib
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from kvadmit.simulate.steptime import CPU_TINY
from kvadmit.vllm.scheduler import KvadmitAsyncScheduler, KvadmitScheduler

COUNTS_ENV = "KVADMIT_BENCH_COUNTS"
EXPECT_ENV = "KVADMIT_BENCH_EXPECT"
STEP_TIMES_ENV = "KVADMIT_BENCH_STEP_TIMES"


def step_context(scheduler, out) -> int:
    """A scheduled step's context as the CPU fit was taken: each scheduled request's
    computed tokens once schedule() has advanced them (the KV attention reads)."""
    return sum(scheduler.requests[r].num_computed_tokens for r in out.num_scheduled_tokens)


def step_modelled_s(scheduler, out) -> float:
    """A scheduled step's time by the CPU step-time fit (bench/fit_cpu_step_time.py)."""
    return CPU_TINY.step_s(out.total_num_scheduled_tokens, step_context(scheduler, out))


class _CountsScheduledTokens:
    """Bench-only scheduler additions:

    - adds up the tokens each step schedules (prompts, recomputation after
      preemption, decodes) and writes the total to $KVADMIT_BENCH_COUNTS, since
      vLLM's own metrics do not count recomputed tokens; beside it, the run's
      modelled time: each step priced by the CPU engine's step-time fit
      (`CPU_TINY`, T = a + b * tokens + c * context), which one run's wall time
      on a shared 2-core machine is too noisy to stand for;
    - holds the first step until $KVADMIT_BENCH_EXPECT requests have arrived, so
      the whole workload is queued before anything runs (a burst) and two runs of
      the same workload schedule identically, whatever the timing of arrivals.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bench_expect = int(os.environ.get(EXPECT_ENV, "0"))
        self._bench_seen = 0
        if self._bench_expect:
            self.set_pause_state(PauseState.PAUSED_ALL)

    def add_request(self, request):
        out = super().add_request(request)
        self._bench_seen += 1
        if self._bench_expect and self._bench_seen == self._bench_expect:
            self.set_pause_state(PauseState.UNPAUSED)
        return out

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        self._bench_tokens = getattr(self, "_bench_tokens", 0) + out.total_num_scheduled_tokens
        path = os.environ.get(COUNTS_ENV)
        if path and out.total_num_scheduled_tokens:
            self._bench_modelled_s = getattr(self, "_bench_modelled_s", 0.0) + step_modelled_s(self, out)
            state = getattr(self, "kvadmit", None)       # None: vLLM's own scheduler
            paused = state.port.paused if state is not None else 0
            pathlib.Path(path).write_text(f"{self._bench_tokens} {paused} {self._bench_modelled_s!r}")
        return out


class CountingVllmScheduler(_CountsScheduledTokens, VllmScheduler):
    """vLLM's own Scheduler, counting scheduled tokens."""


class CountingVllmAsyncScheduler(_CountsScheduledTokens, VllmAsyncScheduler):
    """vLLM's own AsyncScheduler, counting scheduled tokens."""


class CountingKvadmitScheduler(_CountsScheduledTokens, KvadmitScheduler):
    """kvadmit's scheduler, counting scheduled tokens."""


class CountingKvadmitAsyncScheduler(_CountsScheduledTokens, KvadmitAsyncScheduler):
    """kvadmit's async scheduler, counting scheduled tokens."""


class _TimesSteps:
    """Bench-only: times the real engine's steps from inside the scheduler
    (bench/fit_cpu_step_time.py).

    At the start of each schedule() call, appends one line for the PREVIOUS
    step (if it scheduled any tokens) to $KVADMIT_BENCH_STEP_TIMES:
    `interval_s tokens context requests schedule_s start_s`, where interval_s
    is the wall time from the previous schedule() call's start to this one's
    (that step's scheduling, model forward and update_from_output, run serially
    without async scheduling), tokens is its total scheduled tokens, context
    the sum over its scheduled requests of num_computed_tokens after the step
    (the KV length attention reads), requests how many it scheduled,
    schedule_s how long its schedule() took and start_s its start on
    time.perf_counter()'s clock (CLOCK_MONOTONIC on Linux: comparable with
    the parent process's).
    """

    def schedule(self, *args, **kwargs):
        now = time.perf_counter()
        prev = getattr(self, "_bench_prev", None)
        if prev is not None:
            if not hasattr(self, "_bench_times"):
                path = os.environ.get(STEP_TIMES_ENV)
                self._bench_times = open(path, "a", buffering=1) if path else None
            if self._bench_times is not None:
                self._bench_times.write(f"{now - prev[0]:.9f} {prev[1]} {prev[2]} {prev[3]} "
                                        f"{prev[4]:.9f} {prev[0]:.9f}\n")
        out = super().schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            self._bench_prev = (now, out.total_num_scheduled_tokens, step_context(self, out),
                                len(out.num_scheduled_tokens), time.perf_counter() - now)
        else:
            self._bench_prev = None
        return out


class TimingVllmScheduler(_TimesSteps, _CountsScheduledTokens, VllmScheduler):
    """vLLM's own (sync) Scheduler, counting scheduled tokens and timing steps."""


class CountingScheduler:
    """Picks the counting flavour: vLLM's own or kvadmit's (when additional_config
    has a "kvadmit" key), sync or async."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config") or args[0]
        ours = "kvadmit" in (vllm_config.additional_config or {})
        if vllm_config.scheduler_config.async_scheduling:
            impl = CountingKvadmitAsyncScheduler if ours else CountingVllmAsyncScheduler
        else:
            impl = CountingKvadmitScheduler if ours else CountingVllmScheduler
        return impl(*args, **kwargs)
