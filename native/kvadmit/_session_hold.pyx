# Session holds: how long a session's cached KV keeps its place in the eviction
# order after one of its turns ends.
#
# The free queue evicts the least recently freed first. For sessions that come
# back after memoryless tool waits that is already the order of their chance to
# come back (the longer one has been away, the likelier it is done), so nothing
# the engine sees tells it more. What only the client knows is that a session
# will not come back soon: a request's kv_hold_s says so, 0 when the session is
# done, H when it expects to be back within H seconds. A session that ends with
# hold 0, or is not back by its hold, is released: the engine moves its cached
# blocks to the head of the free queue (still reusable, evicted first), so they
# stop pushing out the histories of sessions that are coming back.
#
# A hold can only release KV sooner than the free queue would; it never keeps KV
# longer. So it is not a claim on the pool, and any client may give one.

from cython.operator cimport dereference as deref
from libc.stdint cimport int64_t


cdef class SessionHold:
    """Which sessions' cached KV to release, and when (the engine's clock)."""

    cdef bint c_finished(self, int64_t session, double now, double hold_s) noexcept nogil:
        """A turn of `session` ended at `now` with the client's hold (negative: none).
        True: release the session now (hold 0); H > 0 releases it at now + H unless it
        returns first (c_take_due)."""
        if session < 0 or hold_s < 0:
            return False
        if hold_s == 0:
            self._pending.erase(session)
            self.released += 1
            return True
        self._numbered += 1
        self._pending[session] = self._numbered
        self._due.push(pair[double, pair[int64_t, int64_t]](
            -(now + hold_s), pair[int64_t, int64_t](session, self._numbered)))
        if <int64_t>self._due.size() > 2 * <int64_t>self._pending.size() + 64:
            self._compact()
        return False

    cdef void c_returned(self, int64_t session) noexcept nogil:
        """A request of `session` arrived: its pending hold is void."""
        if session >= 0 and self._pending.erase(session):
            self.came_back += 1

    cdef void c_take_due(self, double now, vector[int64_t]& release) noexcept nogil:
        """Appends to `release` the sessions whose hold ran out by `now` and which did
        not come back."""
        cdef pair[double, pair[int64_t, int64_t]] top
        while not self._due.empty() and -self._due.top().first <= now:
            top = self._due.top()
            self._due.pop()
            if self._live(top.second):
                self._pending.erase(top.second.first)
                release.push_back(top.second.first)
                self.expired += 1

    cdef inline bint _live(self, pair[int64_t, int64_t] entry) noexcept nogil:
        """Whether a due entry (session, number) is its session's pending hold still
        (not voided by a return or replaced by a later turn's hold)."""
        cdef unordered_map[int64_t, int64_t].iterator it = self._pending.find(entry.first)
        return it != self._pending.end() and deref(it).second == entry.second

    cdef void _compact(self) noexcept nogil:
        """Drops the due entries voided since (sessions back, holds replaced): the heap
        stays within twice the pending holds."""
        cdef priority_queue[pair[double, pair[int64_t, int64_t]]] kept
        while not self._due.empty():
            if self._live(self._due.top().second):
                kept.push(self._due.top())
            self._due.pop()
        self._due.swap(kept)

    def finished(self, int64_t session, double now, double hold_s):
        """Python twin of c_finished: whether the session is released now."""
        return self.c_finished(session, now, hold_s)

    def returned(self, int64_t session):
        self.c_returned(session)

    def take_due(self, double now):
        """The sessions whose hold ran out by `now` (each once)."""
        cdef vector[int64_t] out
        self.c_take_due(now, out)
        return [s for s in out]

    @property
    def pending(self):
        """Holds running (sessions away, not yet back or due)."""
        return self._pending.size()

    @property
    def queued(self):
        """Due entries kept, voided ones included (compacted past twice `pending`)."""
        return self._due.size()

    def stats(self):
        return {"released": self.released, "expired": self.expired, "came_back": self.came_back}
