"""kvadmit's failed states in SGLang, from the scheduler that fails to the HTTP server
that shows them (docs/trust-and-failure.md, "When kvadmit itself fails").

`record` is `SGLangAdmission.fail`: in a scheduler process, from an except block. It
counts the error, logs the first with its traceback, moves the Prometheus series
(`kvadmit:internal_errors_total`, `kvadmit:failed_closed`; with --enable-metrics) and,
on the first error, leaves the state for the HTTP server (`write_state`).

The HTTP server runs in another process (SGLang's launcher). The state reaches it as a
file: one per failed scheduler process, named by the state, in a directory of this
launch (`state_dir`: the temporary directory, this user, SGLang's ``SGLANG_RUN_ID``,
which SGLang's launcher sets once per launch before it starts the schedulers, so they
inherit it). `server_state` reads it on every ``GET /health``: a directory listing, no
message to a scheduler that may be busy in a step or stuck, and it works without
--enable-metrics (the Prometheus series need it). A failed state lasts until the
server restarts, and a restart is a new launch: a new directory, nothing stale.

Imports no SGLang.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from typing import Optional

from kvadmit.failed_state import FAILED_CLOSED, FAILED_OPEN, OK
from kvadmit.protocol import FAILED_CLOSED as FAILED_CLOSED_REASON
from kvadmit.sglang.settings import ENV_VAR

logger = logging.getLogger("kvadmit.sglang")

RUN_ID_ENV = "SGLANG_RUN_ID"              # SGLang's launcher: once per launch


def record(adapter, where: str) -> None:
    """One internal error of ``adapter`` (call it from the except block): counted; the
    first is logged with its traceback and its state written for the HTTP server."""
    adapter.internal_errors += 1
    closed = adapter.failed_closed
    if adapter.exporter is not None:
        try:
            adapter.exporter.record_failure(closed)
        except Exception:   # noqa: BLE001 - a metrics failure must not undo failing open
            logger.warning("kvadmit: could not count its internal error in SGLang's "
                           "metrics", exc_info=True)
    if adapter.internal_errors > 1:
        return
    if closed:
        logger.exception("kvadmit: internal error %s; failing closed (on_internal_error: "
                         "closed): every waiting request that has not started and every "
                         "new one is refused (503 kvadmit:%s) until the server is "
                         "restarted; running requests finish under SGLang's own "
                         "scheduling", where, FAILED_CLOSED_REASON)
    else:
        logger.exception("kvadmit: internal error %s; failing open: SGLang's own "
                         "scheduling from now on", where)
    write_state(FAILED_CLOSED if closed else FAILED_OPEN, where)


def state_dir() -> Optional[str]:
    """This launch's directory of failed states; None outside an SGLang launch."""
    run = os.environ.get(RUN_ID_ENV)
    if not run:
        return None
    name = re.sub(r"[^A-Za-z0-9._-]", "_", run)
    return os.path.join(tempfile.gettempdir(), f"kvadmit-{os.getuid()}-{name}")


def write_state(state: str, where: str = "") -> Optional[str]:
    """Leaves ``state`` (FAILED_OPEN or FAILED_CLOSED) of this process for the HTTP
    server; the file's path, or None where it cannot (logged)."""
    directory = state_dir()
    if directory is None:
        logger.warning("kvadmit: %s is not set (not an SGLang launch): the HTTP server "
                       "cannot show kvadmit's %s state", RUN_ID_ENV, state)
        return None
    path = os.path.join(directory, f"{state}.{os.getpid()}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"state": state, "pid": os.getpid(), "where": where,
                       "time": time.time()}, f)
    except OSError as e:
        logger.warning("kvadmit: could not leave its %s state for the HTTP server in %s "
                       "(%s): /health will not show it", state, directory, e)
        return None
    return path


def server_state() -> Optional[str]:
    """For the HTTP server: OK, FAILED_OPEN or FAILED_CLOSED (any scheduler failed
    closed: the server is); None without kvadmit (no KVADMIT_CONFIG) or outside an
    SGLang launch. Never raises."""
    if not os.environ.get(ENV_VAR, "").strip():
        return None
    directory = state_dir()
    if directory is None:
        return None
    try:
        if os.stat(directory).st_uid != os.getuid():   # not this user's: not kvadmit's
            return None
        names = os.listdir(directory)
    except FileNotFoundError:
        return OK
    except OSError:
        return None
    for state in (FAILED_CLOSED, FAILED_OPEN):
        if any(name.startswith(state + ".") for name in names):
            return state
    return OK
