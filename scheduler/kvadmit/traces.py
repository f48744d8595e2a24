"""Loaders for real request traces (Azure LLM inference 2023, Mooncake FAST'25).

Every row becomes a `TraceRequest` or a `TraceError` naming the file, line and
field: nothing is dropped silently. Traces carry the real output length but no
`max_tokens`; choosing one is the replay's job (see `max_tokens_for`).

The package ships both traces whole (`kvadmit/data/`, gzip-compressed, content
unchanged; sources and licences in its README.md): every loader here takes a
bundled trace's name (`BUNDLED`: ``azure2023_conv``, ``mooncake_conversation``) as
well as a path to a .csv / .jsonl file (or the same gzip-compressed, .gz).
"""
from __future__ import annotations

import csv
import datetime
import gzip
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

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
# The traces shipped inside the package: name -> file in DATA_DIR.
BUNDLED = {
    # Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_conv.csv (CC BY 4.0)
    "azure2023_conv": "azure2023_conv.csv.gz",
    # kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl (Apache-2.0)
    "mooncake_conversation": "mooncake_conversation_trace.jsonl.gz",
}
BUNDLED_HELP = "a bundled trace's name (" + ", ".join(BUNDLED) + ") or a path"


def trace_path(trace: str | pathlib.Path) -> pathlib.Path:
    """The file a trace argument names: a bundled trace's name (BUNDLED) is its
    file inside the package; anything else is a path, returned as given."""
    if isinstance(trace, str) and trace in BUNDLED:
        return DATA_DIR / BUNDLED[trace]
    return pathlib.Path(trace)


def trace_name(trace: str | pathlib.Path) -> str:
    """A short name for a trace: a bundled name as is, a path's file name without
    its format and .gz suffixes ("azure2023_conv" for azure2023_conv.csv)."""
    if isinstance(trace, str) and trace in BUNDLED:
        return trace
    name = pathlib.Path(trace).name
    name = name[:-3] if name.endswith(".gz") else name
    return name.rsplit(".", 1)[0] if "." in name else name


def _format(path: pathlib.Path) -> str:
    """The trace format by suffix, a trailing .gz aside: '.csv' or '.jsonl' (or other)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _open_text(path: pathlib.Path, newline: str | None = None):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline=newline)
    return path.open(newline=newline)


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
    path = trace_path(path)
    with _open_text(path, newline="") as f:
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
    path = trace_path(path)
    with _open_text(path) as f:
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
    """Loads a trace, a bundled one by name (BUNDLED) or a file by its suffix: .csv
    (Azure) or .jsonl (Mooncake), either optionally gzip-compressed (.gz)."""
    given, path = path, trace_path(path)
    if not path.exists():
        if isinstance(given, str) and given in BUNDLED:
            raise FileNotFoundError(f"bundled trace {given!r} is missing from this install: {path}")
        raise FileNotFoundError(f"trace not found: {path} (or name a bundled trace: "
                                f"{', '.join(BUNDLED)})")
    fmt = _format(path)
    if fmt == ".csv":
        it = iter_azure(path)
    elif fmt == ".jsonl":
        it = iter_mooncake(path)
    else:
        raise TraceError(f"{path.name}: unknown trace format (expected .csv or .jsonl, "
                         f"optionally .gz)")
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
