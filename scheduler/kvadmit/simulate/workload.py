"""Workloads for the simulator: real traces and synthetic generators.

A `Workload` is columns, one entry a request, in the order requests are added
to an engine: fixed arrival times (not decreasing) for open-loop requests, and
for a session's later turns a parent (the previous turn) and a delay (the
tool/think time after the parent is done). Traces carry the real output length
but no `max_tokens`: the `max_tokens` rule ('cap' or 'context') chooses one.
"""
from __future__ import annotations

import math
import pathlib
import random
import dataclasses
from dataclasses import dataclass, field

from kvadmit._arrival import COLUMNS as RECORD_COLUMNS
from kvadmit._native import Requests
from kvadmit.request_fields import SCHEMA
from kvadmit.traces import load_trace, max_tokens_for, trace_name
from kvadmit.trust import PRIORITY, Trust

FIELDS = {f.name: f for f in SCHEMA}


@dataclass
class Workload:
    name: str
    arrival_s: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    max_tokens: list[int]
    priority: list[int] | None = None
    hash_block_tokens: int = 0                 # tokens per prefix-block id (0: no ids)
    hash_offsets: list[int] | None = None      # CSR: request i's ids are hash_ids[off[i]:off[i+1]]
    hash_ids: list[int] | None = None
    hashed_tokens: list[int] | None = None     # leading tokens the ids describe (default: prompt)
    parent: list[int] | None = None            # previous turn of the session, or -1
    delay_s: list[float] | None = None         # wait after the parent is done
    session: list[int] | None = None
    ttft_slo_s: list[float] | None = None      # per-request targets (None: the run's --slo-*)
    tpot_slo_s: list[float] | None = None
    ttl_s: list[float] | None = None           # per-request TTL in the queue (None: the config's)
    flow: list[int] | None = None              # per-request flow id for the fair share (-1: none)
    sheddable: list[bool] | None = None        # per-request best-effort class (None: none is)
    # Any other arrival record column (kvadmit._arrival.COLUMNS), by name: one entry a request
    record_columns: dict[str, list] = field(default_factory=dict)
    trusted: list[bool] | None = None          # from a trusted source (kvadmit.trust; None: all)
    description: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name, col in (*((name, getattr(self, name)) for name in (
                "prompt_tokens", "output_tokens", "max_tokens", "hashed_tokens", "parent",
                "delay_s", "trusted", *OWN_RECORD_COLUMNS)), *self.record_columns.items()):
            if col is not None and len(col) != n:
                raise ValueError(f"workload {self.name}: {name} has {len(col)} entries, expected {n}")


    def __len__(self) -> int:
        return len(self.arrival_s)

    def requests(self, hash_ids: bool = True) -> Requests:
        """Its requests as the native engine takes them (checked columns; a bad entry
        raises ValueError naming it); ``hash_ids`` False leaves the prefix-block ids
        out (an engine without prefix caching)."""
        with_ids = hash_ids and self.hash_ids is not None
        try:
            return Requests(self.arrival_s, self.prompt_tokens, self.output_tokens,
                            self.max_tokens, parent=self.parent, delay_s=self.delay_s,
                            hashed_tokens=self.hashed_tokens,
                            hash_offsets=self.hash_offsets if with_ids else None,
                            hash_ids=self.hash_ids if with_ids else None,
                            **{c: getattr(self, c) for c in OWN_RECORD_COLUMNS},
                            **self.record_columns)
        except ValueError as e:
            raise ValueError(f"workload {self.name}: {e}") from None

    def screened(self, config) -> "Workload":
        """The requests as kvadmit takes them under `config`'s trust rule
        (kvadmit.trust): an untrusted request's columns that raise its claim take their
        defaults (priority 0), counted by field in meta["untrusted_fields"]."""
        trust = Trust.of(config, {})
        if self.trusted is None or all(self.trusted) or not trust.screens:
            return self
        columns = {**{c: getattr(self, c) for c in OWN_RECORD_COLUMNS}, **self.record_columns}
        columns = {c: list(v) for c, v in columns.items() if v is not None and c != PRIORITY}
        priority = list(self.priority) if self.priority is not None else None
        counts: dict[str, int] = {}
        for i in (i for i, ok in enumerate(self.trusted) if not ok):
            row = {c: v[i] for c, v in columns.items()}
            for name in trust.raised_columns(row, priority[i] if priority else 0):
                counts[name] = counts.get(name, 0) + 1
                if name == PRIORITY:
                    priority[i] = 0
                else:
                    columns[FIELDS[name].column][i] = FIELDS[name].default
        own = {c: v for c, v in columns.items() if c in OWN_RECORD_COLUMNS}
        return dataclasses.replace(
            self, priority=priority, **own,
            record_columns={c: v for c, v in columns.items() if c not in OWN_RECORD_COLUMNS},
            meta={**self.meta, "untrusted_fields": counts})

    def without_kvadmit_fields(self) -> "Workload":
        """The requests as an engine without kvadmit sees them: fields only kvadmit
        reads (kv_hold_s) dropped; the ones its baselines model too (SLO targets,
        priorities) kept."""
        if "kv_hold_s" not in self.record_columns:
            return self
        return dataclasses.replace(self, record_columns={
            c: v for c, v in self.record_columns.items() if c != "kv_hold_s"})

    def hash_ids_of(self, i: int) -> list[int]:
        if self.hash_ids is None:
            return []
        return self.hash_ids[self.hash_offsets[i]:self.hash_offsets[i + 1]]

    def is_open(self, i: int) -> bool:
        """Request i has a fixed arrival time (no parent turn it waits for)."""
        return self.parent is None or self.parent[i] < 0

    def open_loop_span_s(self) -> float:
        t = [a for i, a in enumerate(self.arrival_s) if self.is_open(i)]
        return (t[-1] - t[0]) if len(t) > 1 else 0.0

    def check_block_size(self, block_size: int) -> None:
        """ValueError unless its prefix-id blocks are whole KV blocks of `block_size`."""
        if self.hash_block_tokens and self.hash_block_tokens % block_size:
            raise ValueError(f"workload {self.name}: prefix-id blocks of {self.hash_block_tokens} "
                             f"tokens are not a multiple of block_size={block_size}")

    def sample_interval_s(self) -> float:
        """A run's default timeline sampling: 500 samples over the open-loop span, at
        least every 50 ms."""
        return max(self.open_loop_span_s() / 500.0, 0.05)

    def with_oracle_caps(self) -> "Workload":
        """The same requests with max_tokens = the real output length (the oracle's knowledge)."""
        return dataclasses.replace(self, max_tokens=list(self.output_tokens))

    def scaled(self, factor: float) -> "Workload":
        """Arrivals `factor` times as fast (2.0: twice the rate); session delays unchanged."""
        if not factor > 0:
            raise ValueError(f"rate factor={factor}: must be > 0")
        t0 = self.arrival_s[0] if self.arrival_s else 0.0
        arr = [t0 + (a - t0) / factor if self.is_open(i) else a for i, a in enumerate(self.arrival_s)]
        return dataclasses.replace(self, arrival_s=arr)




# The arrival record's columns Workload holds as fields of its own (prompt_tokens, and
# max_tokens for max_new_tokens, go to Requests first, by position)
OWN_RECORD_COLUMNS = tuple(c for c in RECORD_COLUMNS
                           if c in Workload.__dataclass_fields__ and c != "prompt_tokens")

def from_trace(path: str | pathlib.Path, limit: int | None = None, rate: float = 1.0,
               max_tokens_rule: str = "cap", max_tokens_cap: int = 2048,
               max_model_len: int = 8192, repeat: int = 1) -> Workload:
    """A trace (Azure .csv, Mooncake .jsonl) as a workload. ``rate`` scales the
    arrival rate; ``repeat`` replays the trace back to back that many times (for
    scale runs; Mooncake ids are kept, so later copies hit the earlier prefixes)."""
    if repeat < 1:
        raise ValueError(f"repeat={repeat}: must be >= 1")
    reqs = load_trace(path, limit=limit)
    if not reqs:
        raise ValueError(f"{path}: no requests")
    span = reqs[-1].arrival_s + (reqs[-1].arrival_s / max(len(reqs) - 1, 1))
    arr, prompt, out, mx, off, ids = [], [], [], [], [0], []
    for k in range(repeat):
        for r in reqs:
            arr.append((r.arrival_s + k * span) / rate)
            prompt.append(r.prompt_tokens)
            out.append(r.output_tokens)
            mx.append(max_tokens_for(r, max_tokens_rule, max_tokens_cap, max_model_len))
            ids.extend(r.hash_ids)
            off.append(len(ids))
    has_ids = bool(ids)
    name = trace_name(path)
    return Workload(
        name=name, arrival_s=arr, prompt_tokens=prompt, output_tokens=out, max_tokens=mx,
        hash_block_tokens=512 if has_ids else 0,
        hash_offsets=off if has_ids else None, hash_ids=ids if has_ids else None,
        description=(f"{name}: {len(reqs)} requests{f' x{repeat}' if repeat > 1 else ''} at x{rate:g} "
                     f"the trace rate; max_tokens rule '{max_tokens_rule}' (cap {max_tokens_cap}, "
                     f"context {max_model_len})"),
        meta={"trace": str(path), "limit": limit, "rate": rate, "max_tokens_rule": max_tokens_rule,
              "max_tokens_cap": max_tokens_cap, "repeat": repeat})


def _lognormal_int(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2.0         # so that E[X] = mean
    return max(lo, min(hi, int(round(rng.lognormvariate(mu, sigma)))))


def _arrivals(rng: random.Random, n: int, rate: float, burst_cv: float) -> list[float]:
    """Poisson (cv 1) or Gamma-renewal arrivals with inter-arrival CV `burst_cv` (> 1: bursty)."""
    if not rate > 0:
        raise ValueError(f"rate={rate}: must be > 0 requests/s")
    if not burst_cv > 0:
        raise ValueError(f"burst_cv={burst_cv}: must be > 0")
    shape = 1.0 / (burst_cv * burst_cv)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, 1.0 / (shape * rate))
    return out


def synthetic(n: int, rate: float, seed: int = 0, burst_cv: float = 1.0,
              prompt_mean: float = 1000.0, prompt_sigma: float = 1.0,
              output_mean: float = 200.0, output_sigma: float = 1.2,
              max_tokens_cap: int = 2048, max_model_len: int = 8192) -> Workload:
    """Open-loop requests: Poisson (burst_cv 1) or Gamma-burst arrivals, heavy-tailed
    (lognormal) prompt and output lengths; max_tokens = min(cap, context left)."""
    if n < 1:
        raise ValueError(f"requests={n}: must be >= 1")
    rng = random.Random(seed)
    arr = _arrivals(rng, n, rate, burst_cv)
    prompt, out, mx = [], [], []
    for _ in range(n):
        p = _lognormal_int(rng, prompt_mean, prompt_sigma, 1, max_model_len - 1)
        cap = max(1, min(max_tokens_cap, max_model_len - p))
        o = _lognormal_int(rng, output_mean, output_sigma, 1, cap)
        prompt.append(p)
        out.append(o)
        mx.append(cap)
    kind = "Poisson" if burst_cv == 1.0 else f"Gamma-burst (cv {burst_cv:g})"
    return Workload(name="synthetic", arrival_s=arr, prompt_tokens=prompt, output_tokens=out,
                    max_tokens=mx,
                    description=(f"synthetic: {n} requests, {kind} at {rate:g} req/s, lognormal "
                                 f"prompt mean {prompt_mean:g} / output mean {output_mean:g}, "
                                 f"max_tokens min({max_tokens_cap}, context left), seed {seed}"),
                    meta={"seed": seed, "rate": rate, "burst_cv": burst_cv})


def session_workload(name: str, block_tokens: int) -> Workload:
    """An empty workload of chained session turns, to fill with `append_turn`."""
    return Workload(name=name, arrival_s=[], prompt_tokens=[], output_tokens=[], max_tokens=[],
                    hash_block_tokens=block_tokens, hash_offsets=[0], hash_ids=[], hashed_tokens=[],
                    parent=[], delay_s=[], session=[])


def append_turn(w: Workload, context_ids: list[int], next_id: int, start_s: float, prompt: int,
                out: int, cap: int, prev: int, delay_s: float, session: int) -> int:
    """Appends one turn of `session` to `w`: its prompt (the whole context so far plus
    new tokens) and output, hashed by `context_ids` (the session's block ids so far,
    extended with new ids from `next_id` for this turn's full blocks past the history;
    the last partial block is never shared, so it is dropped again after). The first
    turn (prev < 0) arrives at `start_s`; a later one `delay_s` after turn `prev` ends.
    Returns the next unused id."""
    total = prompt + out
    while len(context_ids) < total // w.hash_block_tokens:
        context_ids.append(next_id)
        next_id += 1
    w.arrival_s.append(start_s if prev < 0 else -1.0)
    w.prompt_tokens.append(prompt)
    w.output_tokens.append(out)
    w.max_tokens.append(cap)
    w.hash_ids.extend(context_ids[:total // w.hash_block_tokens])
    w.hash_offsets.append(len(w.hash_ids))
    w.hashed_tokens.append((total // w.hash_block_tokens) * w.hash_block_tokens)
    w.parent.append(prev)
    w.delay_s.append(delay_s)
    w.session.append(session)
    del context_ids[total // w.hash_block_tokens:]    # the next turn appends after this output
    return next_id


KV_HOLDS = ("none", "done")


def _done_holds(w: Workload) -> list[float]:
    """Each turn's kv_hold_s as a client that knows when its session ends sends it:
    0 (done) on a session's last turn, none (-1) on the others."""
    holds = [0.0] * len(w.parent)
    for p in w.parent:
        if p >= 0:
            holds[p] = -1.0
    return holds


def agent_sessions(sessions: int, rate: float, seed: int = 0, turns_mean: float = 8.0,
                   system_tokens: int = 2048, first_user_mean: float = 1500.0,
                   user_mean: float = 300.0, output_mean: float = 250.0,
                   tool_wait_mean_s: float = 2.0, max_tokens_cap: int = 1024,
                   max_model_len: int = 32768, block_tokens: int = 16,
                   kv_hold: str = "none") -> Workload:
    """Multi-turn agent sessions: sessions start as a Poisson process; each turn's
    prompt is the whole context so far (a shared system prompt, then every earlier
    prompt and output) plus new tool/user tokens, and arrives an exponential tool
    wait after the previous turn is done. Prefix ids (``block_tokens`` tokens each)
    make the shared system prompt and each session's history reusable.

    ``kv_hold``: what the clients tell the engine (the kv_hold_s field): "none", or
    "done" (a session's last turn says the session is done: 0)."""
    if kv_hold not in KV_HOLDS:
        raise ValueError(f"kv_hold={kv_hold!r}: must be one of {', '.join(KV_HOLDS)}")
    if sessions < 1:
        raise ValueError(f"sessions={sessions}: must be >= 1")
    if system_tokens % block_tokens:
        raise ValueError(f"system_tokens={system_tokens}: must be a multiple of block_tokens={block_tokens}")
    rng = random.Random(seed)
    starts = _arrivals(rng, sessions, rate, 1.0)
    w = session_workload("agents", block_tokens)
    next_id = 1 << 40                                  # session content ids; system ids are small
    for s, t0 in enumerate(starts):
        turns = max(1, int(round(rng.expovariate(1.0 / turns_mean))))
        context_ids = list(range(system_tokens // block_tokens))   # the shared system prompt
        context = system_tokens
        prev = -1
        for k in range(turns):
            new = _lognormal_int(rng, first_user_mean if k == 0 else user_mean, 0.8, 1, max_model_len)
            prompt = context + new
            cap = min(max_tokens_cap, max_model_len - prompt)
            if cap < 1:
                break                                   # the session has filled its context
            out = _lognormal_int(rng, output_mean, 1.0, 1, cap)
            total = prompt + out
            delay = 0.0 if prev < 0 else rng.expovariate(1.0 / tool_wait_mean_s)
            next_id = append_turn(w, context_ids, next_id, t0, prompt, out, cap, prev, delay, s)
            prev = len(w.arrival_s) - 1
            context = total
    # Open-loop arrivals must not decrease in list order: sessions are generated in start order.
    w.description = (f"agents: {sessions} sessions ({len(w)} turns), Poisson starts at {rate:g}/s, "
                     f"mean {turns_mean:g} turns, {system_tokens}-token shared system prompt, tool wait "
                     f"mean {tool_wait_mean_s:g} s, seed {seed}")
    if kv_hold != "none":
        w.record_columns["kv_hold_s"] = _done_holds(w)
        w.description += f", clients' kv_hold_s: {kv_hold}"
    w.meta = {"seed": seed, "rate": rate, "sessions": sessions}
    return w


def mixed(n: int, rate: float, seed: int = 0, interactive_share: float = 0.7,
          interactive_slo: tuple[float, float] = (1.0, 0.1),
          batch_slo: tuple[float, float] = (30.0, 0.3),
          max_tokens_cap: int = 2048, max_model_len: int = 8192) -> Workload:
    """Interactive and batch requests mixed, Poisson arrivals, each with its own SLO:
    interactive (share ``interactive_share``): prompts mean 600, outputs mean 150, SLO
    ``interactive_slo`` (TTFT s, TPOT s); batch: prompts mean 3000, outputs mean 500, SLO
    ``batch_slo``. Lognormal lengths; max_tokens = min(cap, context left)."""
    if n < 1:
        raise ValueError(f"requests={n}: must be >= 1")
    if not 0.0 <= interactive_share <= 1.0:
        raise ValueError(f"interactive_share={interactive_share}: must be in [0, 1]")
    rng = random.Random(seed)
    arr = _arrivals(rng, n, rate, 1.0)
    w = Workload(name="mixed", arrival_s=[], prompt_tokens=[], output_tokens=[], max_tokens=[],
                 priority=[], ttft_slo_s=[], tpot_slo_s=[])
    w.arrival_s = arr
    for _ in range(n):
        inter = rng.random() < interactive_share
        p = _lognormal_int(rng, 600.0 if inter else 3000.0, 0.8, 1, max_model_len - 1)
        cap = max(1, min(max_tokens_cap, max_model_len - p))
        o = _lognormal_int(rng, 150.0 if inter else 500.0, 0.9, 1, cap)
        ttft, tpot = interactive_slo if inter else batch_slo
        w.prompt_tokens.append(p)
        w.output_tokens.append(o)
        w.max_tokens.append(cap)
        w.priority.append(0 if inter else 1)
        w.ttft_slo_s.append(ttft)
        w.tpot_slo_s.append(tpot)
    w.description = (f"mixed: {n} requests, Poisson at {rate:g} req/s, {interactive_share:.0%} "
                     f"interactive (SLO TTFT {interactive_slo[0]:g} s / TPOT "
                     f"{interactive_slo[1] * 1e3:g} ms), the rest batch (TTFT {batch_slo[0]:g} s / "
                     f"TPOT {batch_slo[1] * 1e3:g} ms), seed {seed}")
    w.meta = {"seed": seed, "rate": rate, "interactive_share": interactive_share}
    return w
