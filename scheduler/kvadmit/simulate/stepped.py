"""The one contract a driver steps an engine by: `SteppedEngine`.

An engine on a virtual clock that a driver shares: `start(t0)`, then
`add_requests` (arrivals not before the last `advance`'s `until`) and
`advance(until)` in turns, reading `signals()` and `take_rejections()` between
them, and `drain()` at the end; then `results()` and `totals()`. Two engines
implement it:

- `kvadmit._native.NativeEngine`, the compiled engine model;
- `kvadmit.simulate.vllm_engine.VllmEngine`, vLLM's real V1 scheduler in-process
  on the virtual clock.

Two drivers use it and nothing else: one engine replaying a workload
(`replay`: `run_vllm`), and a fleet behind a router (`kvadmit.simulate.fleet`),
which may mix engines.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

from kvadmit._native import Requests


@runtime_checkable
class SteppedEngine(Protocol):
    """An engine a driver steps on its clock (see the module docstring). Times are
    seconds on the driver's virtual clock; a request is known by its index, in the
    order added (over every `add_requests` call)."""

    @property
    def clock(self) -> float:
        """The engine's time: the end of its last step, or where `advance` left it idle."""

    def start(self, t0: float) -> None:
        """Starts the clock at t0 (not after the first arrival added so far)."""

    def add_requests(self, requests: Requests) -> None:
        """Appends requests (`kvadmit.Requests`, checked when built): fixed arrivals not
        before the last `advance`'s `until`, a turn's parent one that has not ended."""

    def advance(self, until: float) -> bool:
        """Runs the steps that start before `until`; True if idle with nothing left
        to arrive."""

    def drain(self) -> None:
        """Steps until every request added is done or refused; checks the KV pool is
        all free again."""

    def take_rejections(self) -> list:
        """Refused since the last call: [(index, reason, time, Retry-After s or None)]."""

    def signals(self) -> dict:
        """What the engine publishes now (a router's scrape): waiting, running, KV
        usage, active blocks, finished, rejected, kvadmit's router signals, clock."""

    def results(self) -> dict:
        """Per request, in the order added: arrival_s, first_token_s, finish_s,
        output_tokens, preemptions, rejected (reason or None)."""

    def totals(self) -> dict:
        """The run's totals (`kvadmit.simulate.record.Totals`' fields)."""


def first_arrival(arrival_s: Sequence[float], parent: Optional[Sequence[int]] = None) -> float:
    """The first fixed (open-loop) arrival: where a replay's clock starts."""
    times = [t for i, t in enumerate(arrival_s) if parent is None or parent[i] < 0]
    if not times:
        raise ValueError("no request has a fixed arrival time (every one has a parent)")
    return min(times)


def replay(engine: SteppedEngine, t0: float, progress=None) -> SteppedEngine:
    """One engine, every request added up front: start at t0 and drain
    (``progress(done, total)``: passed to an engine whose drain reports it)."""
    engine.start(t0)
    if progress is None:
        engine.drain()
    else:
        engine.drain(progress=progress)
    return engine
