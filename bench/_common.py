"""Shared by the bench scripts: machine description, saving results, and the mean
over seeds of runs in a markdown table."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

RESULTS = pathlib.Path(__file__).parent / "results"


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def save(name: str, payload: dict) -> pathlib.Path:
    """Writes bench/results/<name>.json with the command and machine that made it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def mean_rows(per_seed: list[list[dict]], keys) -> list[dict]:
    """Row i of the result: run i's label ("run") and, per key, its mean over the
    seeds (None where a seed has none). `per_seed`: each seed's rows, in one order."""
    out = []
    for rows in zip(*per_seed):
        row = {"run": rows[0]["run"]}
        for k in keys:
            vals = [r.get(k) for r in rows]
            row[k] = sum(vals) / len(vals) if all(v is not None for v in vals) else None
        out.append(row)
    return out


def print_table(rows: list[dict], columns) -> None:
    """A markdown table: the "run" column, then one per (header, key, format)
    ("-" where a row has no value)."""
    print("| run | " + " | ".join(h for h, _, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for r in rows:
        cells = [format(r[k], fmt) if r.get(k) is not None else "-" for _, k, fmt in columns]
        print(f"| {r['run']} | " + " | ".join(cells) + " |")
