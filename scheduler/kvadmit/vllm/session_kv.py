"""Clients' kv_hold_s on vLLM: a session's cached blocks to the head of the free queue.

vLLM frees a finished request's blocks to the tail of its free-block queue (its tail
first), so they are evicted least recently freed first. A client that says its session
is done (kv_hold_s 0), or that is not back by its hold, has those blocks moved to the
head instead: still reusable, evicted before the histories of sessions that are
coming back (kvadmit._session_hold decides which and when; docs/slo-agents.md).

Only the session's own blocks move: those past the prefix its first request found
cached (a shared system prompt, other sessions' content) stay in LRU order, so no
client can push shared KV out. It needs kvadmit's native free-block queue
(`native_allocator`), which can take a block out and put it at the head; vLLM's own
queue cannot without its internals. It runs only with prefix caching and one
full-attention KV group (a request's blocks are its one manager's `req_to_blocks`)."""
from __future__ import annotations

from kvadmit._native import SessionHold

MAX_SESSIONS = 1 << 16    # sessions whose shared prefix is remembered (oldest forgotten first)


class SessionKV:
    """Which blocks of which sessions to move, on one vLLM block pool."""

    def __init__(self, pool, req_to_blocks: dict, block_size: int) -> None:
        self._pool = pool
        self._req_to_blocks = req_to_blocks
        self._block_size = block_size
        self.hold = SessionHold()
        self._request_holds: dict[str, tuple[int, float]] = {}   # request id -> (session, kv_hold_s)
        self._first: dict[str, int] = {}            # request id -> session, until one of its starts
        self._shared: dict[int, int] = {}           # session -> leading blocks it found cached
        self._cached: dict[int, list] = {}          # session -> [(block, hash)] of its own, first first
        self.demoted_blocks = 0

    def arrived(self, request_id: str, record) -> None:
        """A request's arrival record: its session is back (a pending hold is void, its
        remembered blocks are its next turn's); its hold, if any, applies when it ends."""
        session = record.session
        if session < 0:
            return
        self.hold.returned(session)
        self._cached.pop(session, None)
        if session not in self._shared:
            self._first[request_id] = session
        if record.kv_hold_s >= 0:
            self._request_holds[request_id] = (session, record.kv_hold_s)

    def started(self, request_id: str, computed_tokens: int) -> None:
        """A request started with `computed_tokens` found cached: the first of a session
        to start marks where the session's own blocks begin."""
        session = self._first.pop(request_id, None)
        if session is not None and session not in self._shared:
            if len(self._shared) >= MAX_SESSIONS:
                del self._shared[next(iter(self._shared))]
            self._shared[session] = computed_tokens // self._block_size

    def blocks_of(self, request_id: str) -> list | None:
        """The request's own blocks, taken before vLLM frees them (None: no hold to apply)."""
        hold = self._request_holds.get(request_id)
        if hold is None:
            return None
        blocks = self._req_to_blocks.get(request_id, ())
        return list(blocks[self._shared.get(hold[0], 0):])

    def freed(self, request_id: str, blocks: list | None, now: float) -> None:
        """vLLM freed the request's `blocks` at `now`: its session's cached blocks are
        remembered, and released at once if its hold is 0."""
        self._first.pop(request_id, None)
        session, hold_s = self._request_holds.pop(request_id, (-1, -1.0))
        if session < 0:
            return
        self._cached[session] = [(b, b.block_hash) for b in blocks or () if b.block_hash is not None]
        if self.hold.finished(session, now, hold_s):
            self._demote(session)

    def tick(self, now: float) -> None:
        """Before a step: sessions whose hold ran out by `now` are released."""
        for s in self.hold.take_due(now):
            self._demote(s)

    def forget(self, request_id: str) -> None:
        """A request refused before it entered the scheduler."""
        self._request_holds.pop(request_id, None)
        self._first.pop(request_id, None)

    def _demote(self, session: int) -> None:
        # Blocks still free and still holding their content; the session's last block
        # pops first, its first block last (a later turn's prefix hit needs the start).
        blocks = [b for b, h in self._cached.pop(session, ()) if b.ref_cnt == 0 and b.block_hash == h]
        queue = self._pool.free_block_queue
        taken = []
        try:
            for b in blocks:
                queue.remove(b)
                taken.append(b)
        finally:
            queue.prepend_n(taken[::-1])      # taken out, put back: none is lost
        self.demoted_blocks += len(taken)
