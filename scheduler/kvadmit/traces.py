"""Loaders for real request traces (Azure LLM inference 2023, Mooncake FAST'25).

Every row becomes a `TraceRequest` or a `TraceError` naming the file, line and
field: nothing is dropped silently. Traces carry the real output length but no
`max_tokens`; choosing one is the replay's job (see `max_tokens_for`).
"""
from __future__ import annotations

import csv
import datetime
import json
import pathlib
from dataclasses import dataclass
from typing import Iterator, Sequence


class TraceError(ValueError):
    """A malformed trace line; the message names file, line and field."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float            # seconds since the trace's first request
    prompt_tokens: int
    output_tokens: int          # what the model really generated
    hash_ids: tuple[int, ...] = ()   # prefix-block hashes (Mooncake: 512 tokens a block)


AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


def _positive_int(value: str | int, where: str, name: str, minimum: int = 1) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name}={value!r} is not an integer") from None
    if isinstance(value, bool) or n < minimum:
        raise TraceError(f"{where}: {name}={value!r} must be >= {minimum}")
    return n


def _parse_azure_time(text: str, where: str) -> float:
    # '2023-11-16 18:15:46.6805900': seven fraction digits, more than strptime takes.
    base, _, frac = text.strip().partition(".")
    try:
        t = datetime.datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
        return t.replace(tzinfo=datetime.timezone.utc).timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP={text!r} is not 'YYYY-MM-DD HH:MM:SS[.f]'") from None


def iter_azure(path: str | pathlib.Path) -> Iterator[TraceRequest]:
    path = pathlib.Path(path)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != AZURE_HEADER:
            raise TraceError(f"{path.name} line 1: header {header} is not {AZURE_HEADER}")
        t0 = None
        for row in reader:
            where = f"{path.name} line {reader.line_num}"
            if len(row) != 3:
                raise TraceError(f"{where}: expected 3 fields, got {len(row)}")
            t = _parse_azure_time(row[0], where)
            t0 = t if t0 is None else t0
            if t < t0:
                raise TraceError(f"{where}: TIMESTAMP goes back in time")
            yield TraceRequest(t - t0, _positive_int(row[1], where, "ContextTokens"),
                               _positive_int(row[2], where, "GeneratedTokens"))


def iter_mooncake(path: str | pathlib.Path) -> Iterator[TraceRequest]:
    path = pathlib.Path(path)
    with path.open() as f:
        t0 = None
        for lineno, line in enumerate(f, 1):
            where = f"{path.name} line {lineno}"
            if not line.strip():
                raise TraceError(f"{where}: empty line")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in obj:
                    raise TraceError(f"{where}: missing field {key!r}")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
                raise TraceError(f"{where}: timestamp={ts!r} must be a number >= 0 (ms)")
            t0 = ts if t0 is None else t0
            if ts < t0:
                raise TraceError(f"{where}: timestamp goes back in time")
            hashes = obj["hash_ids"]
            if not isinstance(hashes, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) for h in hashes):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            yield TraceRequest((ts - t0) / 1000.0,
                               _positive_int(obj["input_length"], where, "input_length"),
                               _positive_int(obj["output_length"], where, "output_length"),
                               tuple(hashes))


def load_trace(path: str | pathlib.Path, limit: int | None = None) -> list[TraceRequest]:
    """Loads a trace by its suffix: .csv (Azure) or .jsonl (Mooncake)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace not found: {path}")
    if path.suffix == ".csv":
        it = iter_azure(path)
    elif path.suffix == ".jsonl":
        it = iter_mooncake(path)
    else:
        raise TraceError(f"{path.name}: unknown trace format (expected .csv or .jsonl)")
    out = []
    for req in it:
        if limit is not None and len(out) >= limit:
            break
        out.append(req)
    return out


def scale_rate(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Replays at `factor` times the trace's arrival rate (2.0: twice as fast)."""
    if not factor > 0:
        raise ValueError(f"rate factor={factor}: must be > 0")
    return [TraceRequest(r.arrival_s / factor, r.prompt_tokens, r.output_tokens, r.hash_ids)
            for r in requests]


def max_tokens_for(req: TraceRequest, rule: str, cap: int, max_model_len: int) -> int:
    """The `max_tokens` a replay gives a request: 'cap' (a fixed cap) or
    'context' (whatever context remains, at most `cap`). Never below the real output."""
    if rule == "cap":
        m = cap
    elif rule == "context":
        m = min(cap, max_model_len - req.prompt_tokens)
    else:
        raise ValueError(f"max_tokens rule={rule!r}: must be 'cap' or 'context'")
    return max(m, req.output_tokens)
