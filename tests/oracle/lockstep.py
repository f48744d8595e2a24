"""The lockstep-decode model: a test oracle, not an engine.

The core and the native allocator drive a toy engine. Every step, waiting
requests are admitted while the core says so (each takes the blocks for its
prompt and output so far), then every running request decodes one token, taking
a new block when its last one is full. When no block is left the core's victim
is preempted (recompute: its blocks go back, its output is kept).

This is the model under which `reserve` and `peak` guarantee no preemption (and
`auto` with honest max_tokens): tests/test_lockstep.py, test_auto.py and
test_shortfall.py check those guarantees against it, with no step times, chunked
prefill or token budget in the way. Runs with time are the simulator's
(`kvadmit simulate`: the native engine model or vLLM's real scheduler);
bench/lockstep_compare.py reproduces the recorded lockstep table with this model.

With `shortfall: "pause"` a running request the core pauses skips the step
with its blocks kept. A request is (arrival step, prompt tokens, max_new tokens,
true output length).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvadmit._native import AdmissionCore, BlockAllocator
from kvadmit.config import AdmissionConfig
from kvadmit.arrival import ArrivalRecord


@dataclass(frozen=True)
class Request:
    arrival_step: int
    prompt_tokens: int
    max_new_tokens: int
    output_tokens: int  # what the model really produces (<= max_new_tokens)

    def __post_init__(self) -> None:
        if self.arrival_step < 0:
            raise ValueError(f"arrival_step={self.arrival_step}: must be >= 0")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={self.prompt_tokens}: must be >= 1")
        if not 1 <= self.output_tokens <= self.max_new_tokens:
            raise ValueError(
                f"output_tokens={self.output_tokens}: must be in [1, max_new_tokens={self.max_new_tokens}]")


@dataclass
class LockstepResult:
    steps: int = 0
    finished: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    recomputed_tokens: int = 0
    output_tokens: int = 0
    peak_used_blocks: int = 0
    mean_running: float = 0.0
    leaked_blocks: int = 0


def run_lockstep(config: AdmissionConfig, requests: Sequence[Request], num_blocks: int,
                 block_size: int, max_model_len: int = 0, max_steps: int = 10_000_000,
                 progress: callable | None = None) -> LockstepResult:
    """Runs the requests to completion (or rejection) and returns the counts."""
    core = AdmissionCore(config, num_blocks, block_size, max_model_len)
    alloc = BlockAllocator(num_blocks)
    pending = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_step, i))
    req_of: dict[int, Request] = {}           # slot -> request
    blocks: dict[int, list[int]] = {}         # slot -> block ids held
    generated: dict[int, int] = {}            # slot -> tokens generated
    out = LockstepResult()
    running_sum = 0
    next_arrival = 0
    step = 0
    while step < max_steps:
        while next_arrival < len(pending) and requests[pending[next_arrival]].arrival_step <= step:
            r = requests[pending[next_arrival]]
            next_arrival += 1
            res = core.arrive(ArrivalRecord(r.prompt_tokens, r.max_new_tokens), now=float(step))
            if res.accepted:
                req_of[res.slot] = r
                generated[res.slot] = 0
            else:
                out.rejected[res.rejection.reason] = out.rejected.get(res.rejection.reason, 0) + 1
            for slot, rej in res.shed:
                out.rejected[rej.reason] = out.rejected.get(rej.reason, 0) + 1
                del req_of[slot], generated[slot]
        if core.num_waiting == 0 and core.num_running == 0:
            if next_arrival >= len(pending):
                break
            step = max(step + 1, requests[pending[next_arrival]].arrival_step)
            core.on_step(float(step))
            continue
        # Admission: each admitted request takes the blocks for what it holds now.
        while True:
            s = core.next_admissible(alloc.num_free)
            if s < 0:
                break
            r = req_of[s]
            tokens = r.prompt_tokens + generated[s]
            blocks[s] = alloc.allocate(-(-tokens // block_size))
            if generated[s]:
                out.recomputed_tokens += tokens
            core.admit(s, float(step))
        # Decode: every running request computes one token (shortfall "pause": but
        # those the core pauses for lack of blocks).
        order = list(core.running())
        paused = set()
        if config.pause_on_shortfall:
            want = [1] * len(order)
            computed = [req_of[s].prompt_tokens + generated[s] - 1 for s in order]
            paused = {order[i] for i in core.plan_shortfall(
                want, computed, [len(blocks[s]) for s in order], alloc.num_free, len(order))}
        for s in order:
            if core.state(s) != "running" or s in paused:
                continue  # preempted earlier in this step, or paused
            r = req_of[s]
            need = -(-(r.prompt_tokens + generated[s]) // block_size) - len(blocks[s])
            while need > alloc.num_free:
                v = core.victim()
                alloc.free(reversed(blocks.pop(v)))
                core.preempt(v, float(step))
                out.preemptions += 1
                if v == s:
                    break
            if core.state(s) != "running":
                continue
            if need > 0:
                blocks[s].extend(alloc.allocate(need))
        out.peak_used_blocks = max(out.peak_used_blocks, alloc.num_used)
        running_sum += core.num_running
        for s in list(core.running()):
            if s in paused:
                continue
            generated[s] += 1
            out.output_tokens += 1
            r = req_of[s]
            core.update(s, r.prompt_tokens + generated[s] - 1, generated[s])
            if generated[s] >= r.output_tokens:
                alloc.free(reversed(blocks.pop(s)))
                core.finish(s, float(step))
                del req_of[s], generated[s]
                out.finished += 1
        step += 1
        core.on_step(float(step))
        if progress is not None:
            progress(step, out)
    out.steps = step
    out.mean_running = running_sum / step if step else 0.0
    out.leaked_blocks = alloc.num_used
    if core.num_waiting or core.num_running:
        raise RuntimeError(f"lockstep run stopped after {step} steps with "
                           f"{core.num_waiting} waiting and {core.num_running} running")
    return out

