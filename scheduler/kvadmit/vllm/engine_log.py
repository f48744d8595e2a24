"""A terminal a person reads while vLLM engines run: their output goes to a log file.

`EngineLog` captures file descriptors 1 and 2 of this process, and so of every
engine process it starts (vLLM's engine core and workers inherit them): everything
written there (vLLM's INFO logs, Python and native-library warnings, progress bars,
prints) goes to the log file, whole. The terminal gets the caller's own lines
(`say`) and, from the captured output, each distinct warning or error once:

- vLLM log lines at WARNING, ERROR or CRITICAL (vLLM's text format,
  ``(EngineCore pid=N) WARNING 12-01 11:14:13 [file.py:380] message``; a traceback
  logged with a record repeats that prefix on each of its lines);
- Python warnings (``file.py:138: FutureWarning: ...``) and torch's native ones
  (``[W1201 ...] Warning: ...``);
- the closing line of a raw traceback (``ValueError: ...``).

Repeats (every engine start logs the same warnings; lines alike but for their
numbers count as repeats) and the KNOWN_HARMLESS records, tracebacks included, go to
the log only. No vLLM import: the module also loads where vLLM is absent.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager

# vLLM records kept out of the terminal (still in the log), with why.
KNOWN_HARMLESS = {
    # LLM(...) warms the chat template up with a tokenizer; the bench's tiny model runs
    # with skip_tokenizer_init, so the warm-up fails (a traceback per engine) and
    # nothing in the bench uses a chat template.
    "Chat template warmup failed": "the tokenizer-less tiny model has no chat template",
}

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_VLLM = re.compile(r"^\((?P<proc>[^)]*pid=\d+)\) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                   r"(?P<when>\S+ \S+) \[(?P<where>[^\]]+)\] ?(?P<msg>.*)$")
_PY_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: .*$")
_TORCH_WARNING = re.compile(r"^\[W\d+ [^\]]*\] Warning: (?P<msg>.*)$")
_RAISED = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt): .*$")
_SHOWN_LEVELS = ("WARNING", "ERROR", "CRITICAL")
_SYNC = b"\x00kvadmit-engine-log-sync\x00\n"

_active: "EngineLog | None" = None
_say_lock = threading.Lock()


def say(*args, err: bool = False, **kwargs) -> None:
    """print() for the caller's own lines: to the terminal, also while EngineLog
    captures the process's output (to stdout, or stderr with ``err``)."""
    log = _active
    stream = (log.err if err else log.out) if log is not None else (sys.stderr if err else sys.stdout)
    kwargs.setdefault("flush", True)
    if log is not None:
        log.sync()         # what was written before this line shows before it
    with _say_lock:
        print(*args, file=stream, **kwargs)


class EngineLog:
    """Captures fds 1 and 2 into ``path`` (a new file) for the life of the ``with``."""

    def __init__(self, path: str):
        self.path = path
        self.lines = 0              # lines captured
        self.shown = 0              # of them shown on the terminal
        self.harmless = 0           # known-harmless records kept out of the terminal
        self._seen: set[str] = set()
        self._muted: tuple | None = None      # the prefix of a known-harmless record
        self._synced = threading.Condition()
        self._sending = threading.Lock()      # markers numbered in the order written
        self._capturing = False
        self._sync_sent = 0                   # sync markers written into the pipe
        self._sync_seen = 0                   # of them read back by the pump

    # -- the capture -------------------------------------------------------------
    def __enter__(self) -> "EngineLog":
        global _active
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "wb", buffering=0)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self.out = open(self._saved[0], "w", buffering=1, closefd=False, errors="replace")
        self.err = open(self._saved[1], "w", buffering=1, closefd=False, errors="replace")
        read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        self._thread = threading.Thread(target=self._pump, name="kvadmit-engine-log", daemon=True)
        self._thread.start()
        self._capturing = True
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        sys.stdout.flush()
        sys.stderr.flush()
        with self._sending:
            self._capturing = False
        # Back to the terminal: this process no longer holds the pipe's write end, and
        # the reader ends once the engine processes (which hold it too) have exited.
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        self._thread.join(timeout=10)
        _active = None
        self.out.flush()
        self.err.flush()
        os.close(self._saved[0])
        os.close(self._saved[1])

    def sync(self, timeout: float = 2.0) -> None:
        """Wait until the pump has read everything written to fds 1 and 2 before now.
        A marker line goes through the pipe (one write under PIPE_BUF: never split
        from itself by other writers); the pump counts it and keeps it out of the log."""
        if threading.current_thread() is self._thread:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        with self._sending:
            if not self._capturing:
                return
            try:
                os.write(1, _SYNC)
            except OSError:
                return
            with self._synced:
                self._sync_sent += 1
                want = self._sync_sent
        with self._synced:
            self._synced.wait_for(lambda: self._sync_seen >= want, timeout)

    def _pump(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                break
            pending += chunk
            # A marker cut by a read stays in `pending` (its newline ends it) until whole.
            markers = pending.count(_SYNC)
            pending = pending.replace(_SYNC, b"")
            # Whole lines only, their separators kept: the log gets the bytes as written.
            *parts, pending = re.split(rb"(\r\n|\r|\n)", pending)
            for line, sep in zip(parts[0::2], parts[1::2]):
                self._file.write(line + sep)
                self._line(line.decode(errors="replace"))
            if markers:
                with self._synced:
                    self._sync_seen += markers
                    self._synced.notify_all()
        if pending:
            self._file.write(pending)
            self._line(pending.decode(errors="replace"))
        os.close(self._read)
        self._file.close()
        with self._synced:              # nobody waits on a pump that has ended
            self._sync_seen = self._sync_sent
            self._synced.notify_all()

    # -- what reaches the terminal -----------------------------------------------
    def _line(self, raw: str) -> None:
        line = _ANSI.sub("", raw).rstrip()
        if not line:
            return
        self.lines += 1
        m = _VLLM.match(line)
        if m:
            prefix = (m["proc"], m["level"], m["when"], m["where"])
            if prefix == self._muted:          # the rest of a known-harmless record
                return
            self._muted = None
            if m["level"] not in _SHOWN_LEVELS:
                return
            if any(m["msg"].startswith(k) for k in KNOWN_HARMLESS):
                self._muted = prefix           # its traceback lines carry the same prefix
                self.harmless += 1
            elif self._first(f"{m['level']} [{m['where']}] {m['msg']}"):
                self._show(f"vLLM {m['level']} [{m['where']}] {m['msg']}")
            return
        self._muted = None
        t = _TORCH_WARNING.match(line)
        if t:
            if self._first(t["msg"]):
                self._show(f"torch warning: {t['msg']}")
        elif _PY_WARNING.match(line) or _RAISED.match(line):
            if self._first(line):
                self._show(line)

    def _first(self, key: str) -> bool:
        """Whether this is the first line like it (numbers aside: pids, counts)."""
        key = re.sub(r"\d+", "#", key)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def _show(self, text: str) -> None:
        self.shown += 1
        with _say_lock:
            print(text, file=self.err, flush=True)

    def summary(self) -> str:
        return (f"engine log: {self.lines} lines in {self.path} (vLLM's INFO logs and progress "
                f"bars; {self.shown} warning lines shown above, each once"
                + (f"; {self.harmless} known-harmless records, "
                   + "; ".join(f"'{k}': {why}" for k, why in KNOWN_HARMLESS.items())
                   if self.harmless else "") + ")")

    def tail(self, n: int = 40) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                text = f.read()[-200_000:].decode(errors="replace")
        except OSError:
            return []
        return [_ANSI.sub("", x) for x in re.split(r"\r\n|\r|\n", text) if x.strip()][-n:]


@contextmanager
def engine_log(path: str | None):
    """EngineLog(path) around the body (None or '': no capture), naming the log on the
    terminal first and its totals after; if the body raises, the log's last lines."""
    if not path:
        yield None
        return
    t0 = time.perf_counter()
    log = EngineLog(path)
    failed = True
    try:
        with log:
            say(f"vLLM's engine output goes to {path}; its warnings show here once each", err=True)
            yield log
            failed = False
    finally:
        if failed:          # the capture has ended: this reaches the terminal
            print(f"failed after {time.perf_counter() - t0:.0f} s; the last lines of {path}:",
                  file=sys.stderr, flush=True)
            for line in log.tail():
                print(f"  | {line}", file=sys.stderr, flush=True)
        else:
            say(log.summary(), err=True)
