"""Shared by the bench scripts: machine description and saving results."""
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
