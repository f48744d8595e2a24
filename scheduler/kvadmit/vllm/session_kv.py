"""Clients' kv_hold_s on vLLM: a session's cached blocks to the head of the free queue.

vLLM frees a finished request's blocks to the tail of its free-block queue (its tail
first), so they are evicted least recently freed first. A client that says its session
is done (kv_hold_s 0), or that is not back by its hold, has those blocks moved to the
head instead: still reusable, evicted before the histories of sessions that are
coming back (kvadmit._session_hold decides which and when; docs/slo-agents.md).

It needs kvadmit's native free-block queue (`native_allocator`), which can take a
block out and put it at the head; vLLM's own queue cannot without its internals. It
runs only with prefix caching and one full-attention KV group (the blocks of a request
are its one manager's `req_to_blocks`)."""
from __future__ import annotations

from kvadmit._native import SessionHold


class SessionKV:
    """Which blocks of which sessions to move, on one vLLM block pool."""

    def __init__(self, pool, req_to_blocks: dict) -> None:
        self._pool = pool
        self._req_to_blocks = req_to_blocks
        self.hold = SessionHold()
        self._holds: dict[str, tuple[int, float]] = {}      # request id -> (session, kv_hold_s)
        self._cached: dict[int, list] = {}                   # session -> [(block, hash)], first first
        self.demoted_blocks = 0

    def arrived(self, request_id: str, record) -> None:
        """A request's arrival record: its session is back (a pending hold is void);
        its hold, if it gives one, applies when it ends."""
        if record.session < 0:
            return
        self.hold.returned(record.session)
        if record.kv_hold_s >= 0:
            self._holds[request_id] = (record.session, record.kv_hold_s)

    def blocks_of(self, request_id: str) -> list | None:
        """The request's blocks, taken before vLLM frees them (None: no hold to apply)."""
        if request_id not in self._holds:
            return None
        return list(self._req_to_blocks.get(request_id, ()))

    def freed(self, request_id: str, blocks: list | None, now: float) -> None:
        """vLLM freed the request's `blocks` at `now`: its session's cached blocks are
        remembered, and released at once if its hold is 0."""
        session, hold_s = self._holds.pop(request_id, (-1, -1.0))
        if session < 0:
            return
        self._cached[session] = [(b, b.block_hash) for b in blocks or () if b.block_hash is not None]
        for s in self.hold.finished(session, now, hold_s):
            self._demote(s)

    def tick(self, now: float) -> None:
        """Before a step: sessions whose hold ran out by `now` are released."""
        for s in self.hold.take_due(now):
            self._demote(s)

    def forget(self, request_id: str) -> None:
        self._holds.pop(request_id, None)

    def _demote(self, session: int) -> None:
        # Blocks still free and still holding their content; the session's last block
        # pops first, its first block last (a later turn's prefix hit needs the start).
        blocks = [b for b, h in self._cached.pop(session, ()) if b.ref_cnt == 0 and b.block_hash == h]
        queue = self._pool.free_block_queue
        for b in blocks:
            queue.remove(b)
        queue.prepend_n(blocks[::-1])
        self.demoted_blocks += len(blocks)
