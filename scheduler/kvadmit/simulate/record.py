"""What a simulated engine run records: per-request times and counts, and totals.

One definition of the run's accounting for the Python engine drivers (vLLM's
scheduler on the virtual clock, `kvadmit.simulate.vllm_engine`); the compiled
native engine (`native/kvadmit/_native_engine.pyx`) keeps the same counters with the same
definitions, both report them as one `Totals`, and the parity tests
(tests/simulate/test_vllm_engine.py) hold both to the same numbers:
- a step is a schedule that computed tokens; its batch is its scheduled tokens;
- recomputed tokens: tokens computed again below the most a request had computed
  (after a preemption threw its KV away);
- prefill tokens: computed tokens below the prompt length, first time or again;
- a preemption counts for the request it sent back to waiting;
- a request is done when it finishes (its tokens stamped at the step's end) or
  refused (with the reason) -- never both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PENDING, IN_ENGINE, DONE, REJECTED = 0, 1, 2, 3


@dataclass(frozen=True)
class Totals:
    """A run's totals, the same fields from every engine driver: `RunRecord.totals`
    (vLLM's scheduler) builds it, `Totals.from_engine` checks the native engine's
    dict against it (a counter one engine adds and the other lacks fails there, and
    in tests/simulate/test_vllm_engine.py). The field order is the JSON key order."""
    steps: int
    preemptions: int
    recomputed_tokens: int
    output_tokens: int
    prefill_tokens: int
    batch_tokens: int
    prefix_hit_tokens: int        # prefix-cache hits over queries, counted at each admission
    prefix_query_tokens: int
    held_for_blocks: int          # admissions the core held for lack of blocks (vLLM: 0, unknown)
    makespan_s: float             # first open-loop arrival to the last step's end
    busy_s: float                 # modelled time spent in steps
    kv_util_mean: float           # block-seconds used over makespan x pool
    kv_util_peak: float
    finished: int
    rejected: int
    free_blocks_at_end: int

    @classmethod
    def from_engine(cls, counts: dict) -> "Totals":
        """The totals of an engine that reports them as a dict (`NativeEngine.totals()`):
        its keys must be exactly these fields."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [k for k in names if k not in counts]
        extra = [k for k in counts if k not in names]
        if missing or extra:
            raise ValueError(f"engine totals do not match Totals: missing {missing}, "
                             f"not in Totals {extra}")
        return cls(**counts)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class RunRecord:
    def __init__(self, n: int, num_blocks: int, t0: float, sample_interval_s: float):
        self.n = n
        self.num_blocks = num_blocks
        self.t0 = t0
        # per request, in workload order
        self.arrival = [-1.0] * n
        self.first_token = [-1.0] * n
        self.finish = [-1.0] * n
        self.output_tokens = [0] * n
        self.preemptions_of = [0] * n
        self.max_computed = [0] * n
        self.reason: list[str | None] = [None] * n
        self.state = [PENDING] * n
        # totals
        self.steps = self.preemptions = self.recomputed = self.out_tokens = 0
        self.prefill_tokens = self.batch_tokens = self.peak_used = 0
        self.kv_block_s = self.busy_s = 0.0
        self.finished = self.rejected = 0
        self.timeline = {"t": [], "used_blocks": [], "running": [], "waiting": [], "preemptions": []}
        self._sample_dt = sample_interval_s
        self._next_sample = t0

    def extend(self, k: int) -> None:
        """k more requests (a stepped engine's `add_requests`)."""
        self.n += k
        for col, v in ((self.arrival, -1.0), (self.first_token, -1.0), (self.finish, -1.0),
                       (self.output_tokens, 0), (self.preemptions_of, 0), (self.max_computed, 0),
                       (self.reason, None), (self.state, PENDING)):
            col.extend([v] * k)

    def start(self, t0: float) -> None:
        """The run's clock starts at t0 (a stepped engine's `start`): the makespan and
        the timeline count from it."""
        self.t0 = self._next_sample = t0

    @property
    def done(self) -> int:
        return self.finished + self.rejected

    def arrive(self, i: int, t: float) -> None:
        self.arrival[i] = t
        self.state[i] = IN_ENGINE

    def reject(self, i: int, why: str, t: float) -> None:
        self.state[i] = REJECTED
        self.reason[i] = why
        self.finish[i] = t
        self.rejected += 1

    def preempt(self, i: int) -> None:
        self.preemptions_of[i] += 1
        self.preemptions += 1

    def compute(self, i: int, c0: int, c1: int, prompt: int) -> None:
        """Request i's KV went from c0 to c1 computed tokens in this step."""
        if c0 < self.max_computed[i]:
            self.recomputed += min(c1, self.max_computed[i]) - c0
        if c1 > self.max_computed[i]:
            self.max_computed[i] = c1
        if c0 < prompt:
            self.prefill_tokens += min(c1, prompt) - c0

    def step(self, tokens: int, seconds: float, used_blocks: int) -> None:
        """A step that scheduled `tokens` tokens, took `seconds`, with `used_blocks` in use."""
        self.peak_used = max(self.peak_used, used_blocks)
        self.kv_block_s += used_blocks * seconds
        self.busy_s += seconds
        self.batch_tokens += tokens
        self.steps += 1

    def emit(self, i: int, tokens: int, t: float) -> None:
        self.output_tokens[i] += tokens
        self.out_tokens += tokens
        if self.first_token[i] < 0:
            self.first_token[i] = t

    def complete(self, i: int, t: float) -> None:
        self.state[i] = DONE
        self.finish[i] = t
        self.finished += 1

    def sample(self, clock: float, used_blocks: int, running: int, waiting: int) -> None:
        """Timeline samples every sample interval of virtual time up to `clock`."""
        tl = self.timeline
        while clock >= self._next_sample:
            tl["t"].append(self._next_sample)
            tl["used_blocks"].append(used_blocks)
            tl["running"].append(running)
            tl["waiting"].append(waiting)
            tl["preemptions"].append(self.preemptions)
            self._next_sample += self._sample_dt

    def due_sample(self, clock: float) -> bool:
        return clock >= self._next_sample

    def unfinished(self) -> list[int]:
        return [i for i in range(self.n) if self.state[i] not in (DONE, REJECTED)]

    def totals(self, clock: float, free_blocks: int, *, prefix_hit_tokens: int,
               prefix_query_tokens: int, held_for_blocks: int) -> Totals:
        """The run's totals at `clock`; the engine's own counters are its to give."""
        span = clock - self.t0
        nb = self.num_blocks
        return Totals(
            steps=self.steps, preemptions=self.preemptions,
            recomputed_tokens=self.recomputed, output_tokens=self.out_tokens,
            prefill_tokens=self.prefill_tokens, batch_tokens=self.batch_tokens,
            prefix_hit_tokens=prefix_hit_tokens, prefix_query_tokens=prefix_query_tokens,
            held_for_blocks=held_for_blocks,
            makespan_s=span, busy_s=self.busy_s,
            kv_util_mean=self.kv_block_s / (span * nb) if span > 0 else 0.0,
            kv_util_peak=self.peak_used / nb,
            finished=self.finished, rejected=self.rejected,
            free_blocks_at_end=free_blocks)

    def per_request(self) -> dict:
        return {"arrival_s": self.arrival, "first_token_s": self.first_token,
                "finish_s": self.finish, "output_tokens": self.output_tokens,
                "preemptions": self.preemptions_of, "rejected": self.reason}
