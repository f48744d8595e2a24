# The simulator's native engine, its state: the requests (arrival records, arrival
# times, session turns released when their parent ends), their progress and KV blocks
# in the core's BlockAllocator, prefix-cache hashes and hits, arrivals into the core,
# and the results, totals and timeline read from them. The step loop is NativeEngine's
# (kvadmit._native_engine).

from cython.operator cimport dereference as deref
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.pair cimport pair
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._arrival_gate cimport ArrivalResult, Rejection
from kvadmit._curves cimport cdiv
from kvadmit._requests cimport Requests

from kvadmit._arrival_gate import REJECT_REASONS


cdef inline uint64_t _mix_hash(uint64_t prev, uint64_t value, uint64_t index) noexcept nogil:
    """Chained block hash (splitmix64 finaliser over prev, value and index)."""
    cdef uint64_t x = prev * <uint64_t>0x9E3779B97F4A7C15 + value
    x ^= (index + <uint64_t>0x632BE59BD9B4E019) * <uint64_t>0xD6E8FEB86659FD93
    x ^= x >> 30
    x *= <uint64_t>0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= <uint64_t>0x94D049BB133111EB
    x ^= x >> 31
    return x


cdef class EngineState:
    """What a NativeEngine holds and reports (its step loop is NativeEngine's)."""

    def add_requests(self, Requests requests not None):
        """Appends `kvadmit._requests.Requests` (checked when built); here only what
        depends on the engine's state: fixed arrivals not before the ones added
        before (nor before the last `advance`'s horizon when stepped), and a turn's
        parent an earlier request that has not ended (its children were released
        when it ended). A refused batch leaves the engine as it was."""
        if self._ran and not self._stepping:
            raise RuntimeError("add_requests after run")
        cdef Py_ssize_t n = requests.records.size(), i, base = self._arr.size()
        cdef int64_t h0 = self._hids.size()
        requests.check_append(
            base, self._arr[self._open.back()] if not self._open.empty() else -INFINITY,
            self._horizon if self._stepping else -INFINITY, self._ended_at)
        for i in range(n):
            if requests.parent[i] < 0:
                self._open.push_back(base + i)
            self._prompt.push_back(requests.records[i].prompt_tokens)
            self._hoff.push_back(h0 + (requests.hash_offsets[i + 1] if self._prefix else 0))
        self._rec.insert(self._rec.end(), requests.records.begin(), requests.records.end())
        self._arr.insert(self._arr.end(), requests.arrival_s.begin(), requests.arrival_s.end())
        self._parent.insert(self._parent.end(), requests.parent.begin(), requests.parent.end())
        self._delay.insert(self._delay.end(), requests.delay_s.begin(), requests.delay_s.end())
        self._out.insert(self._out.end(), requests.output_tokens.begin(),
                         requests.output_tokens.end())
        self._hashed.insert(self._hashed.end(), requests.hashed_tokens.begin(),
                            requests.hashed_tokens.end())
        if self._prefix:
            self._hids.insert(self._hids.end(), requests.hash_ids.begin(), requests.hash_ids.end())
        self._extend_request_state(base)

    def _ended_at(self, Py_ssize_t r):
        """When request r finished or was refused (None: it has not)."""
        return self._t_done[r] if self._rstate[r] == RQ_DONE or self._rstate[r] == RQ_REJECTED \
            else None

    cdef void _extend_request_state(self, Py_ssize_t base):
        """The per-request state of the requests added from index `base` on."""
        cdef Py_ssize_t i, total = self._arr.size()
        self._computed.resize(total, 0)
        self._gen.resize(total, 0)
        self._maxcomp.resize(total, 0)
        self._sched.resize(total, 0)
        self._slot.resize(total, -1)
        self._npre.resize(total, 0)
        self._is_paused.resize(total, 0)
        self._rstate.resize(total, RQ_PENDING)
        self._reason.resize(total, -1)
        self._retry.resize(total, -1.0)
        self._t_first.resize(total, -1.0)
        self._t_done.resize(total, -1.0)
        self._blocks.resize(total)
        self._hashes.resize(total)
        self._children.resize(total)
        for i in range(base, total):
            if self._parent[i] >= 0:
                self._children[self._parent[i]].push_back(i)

    # ------------------------------------------------------------------
    cdef uint64_t _block_hash(self, int32_t r, int64_t j) noexcept nogil:
        """Hash of request r's j-th block (tokens [j*bs, (j+1)*bs)): chained over
        the trace's prefix-block ids while the block lies inside the tokens they
        describe, over a per-request value after that (unique content)."""
        cdef vector[uint64_t]* hs = &self._hashes[r]
        cdef int64_t jj, k, nids = self._hoff[r + 1] - self._hoff[r]
        cdef uint64_t prev
        jj = hs.size()
        while jj <= j:
            prev = hs.back() if jj > 0 else 0
            k = (jj * self._bs) // self._hash_block if self._hash_block else nids
            if k < nids and (jj + 1) * self._bs <= self._hashed[r]:
                hs.push_back(_mix_hash(prev, <uint64_t>self._hids[self._hoff[r] + k],
                                       <uint64_t>((jj * self._bs) % self._hash_block)))
            else:
                hs.push_back(_mix_hash(prev, (<uint64_t>1 << 62) + <uint64_t>r, <uint64_t>jj))
            jj += 1
        return deref(hs)[j]

    cdef void _release_blocks(self, int32_t r) noexcept nogil:
        """Gives r's blocks back, tail first (so its tail is evicted first)."""
        cdef vector[int32_t]* b = &self._blocks[r]
        cdef size_t i, n = b.size()
        cdef int32_t tmp
        for i in range(n // 2):
            tmp = deref(b)[i]
            deref(b)[i] = deref(b)[n - 1 - i]
            deref(b)[n - 1 - i] = tmp
        self.allocator.c_free(b.data(), n)
        b.clear()

    cdef int64_t _freed_blocks(self, int32_t r) noexcept nogil:
        """The blocks r's preemption would free: those no other request shares."""
        cdef int64_t n = 0
        cdef size_t j
        for j in range(self._blocks[r].size()):
            n += self.allocator.c_ref_count(self._blocks[r][j]) == 1
        return n

    cdef bint _grow(self, int32_t r, int64_t upto_tokens) noexcept nogil:
        """Takes the blocks r needs to hold `upto_tokens`; False if too few are free."""
        cdef int64_t need = cdiv(upto_tokens, self._bs) - <int64_t>self._blocks[r].size()
        if need <= 0:
            return True
        cdef size_t old = self._blocks[r].size()
        if need > self.allocator.c_num_free():
            return False
        self._blocks[r].resize(old + need)
        self.allocator.c_allocate(need, self._blocks[r].data() + old)
        return True

    cdef void _demote_sessions(self, bint window=True) noexcept nogil:
        """The prefixes of sessions the agent window paused or expired (CONCUR; not
        taken when `window` is False), and of sessions not back by their client's hold
        (kv_hold_s), go to the front of the free queue: still reusable, evicted before
        those of sessions coming back."""
        cdef size_t i
        self._demoting.clear()
        if window:
            self.core.agent_window.c_take_paused(self._demoting)
        self.session_hold.c_take_due(self._clock, self._demoting)
        for i in range(self._demoting.size()):
            self._demote_session(self._demoting[i])

    cdef void _demote_session(self, int64_t session) noexcept nogil:
        """The session's own cached blocks (as its latest turn left them) to the free
        queue's head. Each demotion goes in front of the last, so walking first to last
        leaves its last block taken first and its first block last (a prefix hit needs
        the start)."""
        cdef unordered_map[int64_t, vector[pair[int32_t, uint64_t]]].iterator it
        it = self._sess_blocks.find(session)
        if it == self._sess_blocks.end():
            return
        cdef size_t j
        for j in range(deref(it).second.size()):
            self.allocator.c_demote(deref(it).second[j].first, deref(it).second[j].second)
        self._sess_blocks.erase(it)

    cdef size_t _running_erase(self, int32_t r) noexcept nogil:
        """Takes r out of the running list (the others' order kept); its old index."""
        cdef size_t i
        for i in range(self._running.size()):
            if self._running[i] == r:
                self._running.erase(self._running.begin() + i)
                return i
        return self._running.size()

    cdef void _finish(self, int32_t r, double t) noexcept nogil:
        self.core.c_finish(self._slot[r], t)
        cdef size_t i
        cdef int32_t b
        cdef uint64_t h
        cdef int64_t session = self._rec[r].session
        if self._prefix and session >= 0 and (self.core.agent_window.enabled
                                               or self._rec[r].kv_hold_s >= 0):
            # The session's own context so far (past the prefix its first request found
            # cached: others' too), for demotion if it is paused or released later.
            self._sess_blocks[session].clear()
            for i in range(self._sess_shared[session], self._blocks[r].size()):
                b = self._blocks[r][i]
                if self.allocator.c_held_hash(b, &h):
                    self._sess_blocks[session].push_back(pair[int32_t, uint64_t](b, h))
        self._release_blocks(r)
        if self._prefix and self.session_hold.c_finished(session, t, self._rec[r].kv_hold_s):
            self._demote_session(session)
        self._slot_req[self._slot[r]] = -1
        self._slot[r] = -1
        self._rstate[r] = RQ_DONE
        self._t_done[r] = t
        self._n_done += 1
        self._hashes[r].clear()
        self._hashes[r].shrink_to_fit()
        self._blocks[r].shrink_to_fit()
        self._release_children(r, t)

    cdef void _release_children(self, int32_t r, double t) noexcept nogil:
        """A session's next turns arrive their delay after r is done."""
        cdef int64_t c
        cdef vector[int64_t]* kids = &self._children[r]
        cdef size_t i
        for i in range(kids.size()):
            c = deref(kids)[i]
            self._arr[c] = t + self._delay[c]
            self._released.push(pair[double, int64_t](-self._arr[c], -c))

    cdef void _reject(self, int32_t r, Rejection rej):
        self._rstate[r] = RQ_REJECTED
        self._reason[r] = REJECT_REASONS.index(rej.reason)
        self._retry[r] = rej.retry_after_s if rej.retry_after_s is not None else -1.0
        self._rej_log.push_back(r)
        self._t_done[r] = self._clock
        self._n_rejected += 1
        self._hashes[r].clear()
        self._release_children(r, self._clock)

    cdef double _next_arrival(self) noexcept nogil:
        """Time of the next arrival not yet processed (INFINITY: none known yet)."""
        cdef double t = INFINITY
        if self._next < <int64_t>self._open.size():
            t = self._arr[self._open[self._next]]
        if not self._released.empty() and -self._released.top().first < t:
            t = -self._released.top().first
        return t

    cdef int32_t _pop_arrival(self) noexcept nogil:
        cdef int32_t r
        if not self._released.empty() and (self._next >= <int64_t>self._open.size() or
                -self._released.top().first < self._arr[self._open[self._next]] or
                (-self._released.top().first == self._arr[self._open[self._next]] and
                 -self._released.top().second < self._open[self._next])):
            r = <int32_t>(-self._released.top().second)
            self._released.pop()
            return r
        r = <int32_t>self._open[self._next]
        self._next += 1
        return r

    cdef int _arrivals(self) except -1:
        cdef int32_t r
        cdef ArrivalResult res
        while self._next_arrival() <= self._clock:
            r = self._pop_arrival()
            self.session_hold.c_returned(self._rec[r].session)
            res = self.core.c_arrive(&self._rec[r], self._arr[r])
            self._drop_shed(res.shed)
            if not res.accepted:
                self._reject(r, res.rejection)
                continue
            if res.slot >= <int64_t>self._slot_req.size():
                self._slot_req.resize(res.slot + 1, -1)
            self._slot_req[res.slot] = r
            self._slot[r] = <int32_t>res.slot
            self._rstate[r] = RQ_WAITING
        self._drop_shed(self.core.c_drop_waiting(self._clock))   # stale work, before admission
        return 0

    cdef int _drop_shed(self, list shed) except -1:
        """Waiting requests the core dropped: [(slot, Rejection)]."""
        cdef int32_t v
        for slot, rej in shed:
            v = self._slot_req[slot]
            self._slot_req[slot] = -1
            self._slot[v] = -1
            self._reject(v, rej)
        return 0

    cdef int64_t _prefix_hit_blocks(self, int32_t r, int64_t tokens, int64_t* fresh) noexcept nogil:
        """Leading cached blocks r can share (at most (tokens - 1) / bs, as vLLM:
        the last token is always computed); `fresh` gets how many are cached-free,
        `_hit_ids` their block ids."""
        cdef int64_t j, lim = (tokens - 1) // self._bs
        cdef int32_t b
        fresh[0] = 0
        self._hit_ids.clear()
        for j in range(lim):
            b = self.allocator.c_lookup(self._block_hash(r, j))
            if b < 0:
                return j
            self._hit_ids.push_back(b)
            if self.allocator.c_ref_count(b) == 0:
                fresh[0] += 1
        return lim

    cdef bint _is_hit(self, int32_t b) noexcept nogil:
        """Whether block b is one of the admission candidate's prefix hits (`_hit_ids`)."""
        cdef size_t i
        for i in range(self._hit_ids.size()):
            if self._hit_ids[i] == b:
                return True
        return False

    cdef void _sample_timeline(self) noexcept nogil:
        while self._clock >= self._next_sample:
            self._tl_t.push_back(self._next_sample)
            self._tl_used.push_back(self._nblocks - self.allocator.c_num_free())
            self._tl_running.push_back(self._running.size())
            self._tl_waiting.push_back(self.core.c_num_waiting())
            self._tl_preempt.push_back(self._preemptions)
            self._tl_hit.push_back(self._hit_tokens)
            self._tl_query.push_back(self._query_tokens)
            self._tl_window.push_back(self.core.agent_window.c_size())
            self._next_sample += self._sample_dt

    @property
    def clock(self):
        return self._clock

    def core_stats(self):
        """The core's stats() (its counters: holds, refusals by reason, preemptions)."""
        return self.core.stats()

    def take_rejections(self):
        """The requests refused since the last call, in order: (index, reason,
        engine time of the refusal, Retry-After in seconds or None)."""
        cdef list out = []
        cdef int32_t r
        while self._rej_taken < self._rej_log.size():
            r = self._rej_log[self._rej_taken]
            self._rej_taken += 1
            out.append((r, REJECT_REASONS[self._reason[r]], self._t_done[r],
                        self._retry[r] if self._retry[r] >= 0 else None))
        return out

    def signals(self):
        """What the engine publishes now: the core's `router_signals()`, vLLM's
        gauges (waiting, running, KV usage), the blocks running requests hold
        (Dynamo's active decode blocks), requests finished and refused so far,
        prefix-cache hit and query tokens so far, and the engine's clock."""
        cdef int64_t used = self._nblocks - self.allocator.c_num_free()
        sig = self.core.router_signals()
        sig["num_requests_waiting"] = self.core.c_num_waiting()
        sig["num_requests_running"] = self._running.size()
        sig["kv_cache_usage_perc"] = used / <double>self._nblocks
        sig["active_blocks"] = used
        sig["num_blocks"] = self._nblocks
        sig["finished"] = self._n_done
        sig["rejected"] = self._n_rejected
        sig["preemptions"] = self._preemptions
        sig["prefix_hit_tokens"] = self._hit_tokens
        sig["prefix_query_tokens"] = self._query_tokens
        sig["clock_s"] = self._clock
        return sig

    def results(self):
        """Per request, in the order added: arrival, first-token and finish times
        (s, -1 if none), output tokens, preemptions, rejection reason (None if served)."""
        return {
            "arrival_s": [t for t in self._arr],
            "first_token_s": [t for t in self._t_first],
            "finish_s": [t for t in self._t_done],
            "output_tokens": [g for g in self._gen],
            "preemptions": [p for p in self._npre],
            "rejected": [REJECT_REASONS[c] if c >= 0 else None for c in self._reason],
        }

    def totals(self):
        cdef double span = self._clock - self._t0
        return {
            "steps": self._steps, "preemptions": self._preemptions,
            "recomputed_tokens": self._recomputed, "output_tokens": self._out_tokens,
            "prefill_tokens": self._prefill_tokens, "batch_tokens": self._batch_tokens,
            "prefix_hit_tokens": self._hit_tokens, "prefix_query_tokens": self._query_tokens,
            "held_for_blocks": self._held_blocks,
            "makespan_s": span, "busy_s": self._busy_s,
            "kv_util_mean": self._kv_block_s / (span * self._nblocks) if span > 0 else 0.0,
            "kv_util_peak": self._peak_used / <double>self._nblocks,
            "finished": self._n_done, "rejected": self._n_rejected,
            "free_blocks_at_end": self.allocator.c_num_free(),
        }

    def timeline(self):
        """Samples every sample_interval_s of virtual time: time, used blocks,
        running, waiting, preemptions, prefix hit and query tokens so far, and
        the agent window."""
        return {"t": [x for x in self._tl_t], "used_blocks": [x for x in self._tl_used],
                "running": [x for x in self._tl_running], "waiting": [x for x in self._tl_waiting],
                "preemptions": [x for x in self._tl_preempt],
                "prefix_hit_tokens": [x for x in self._tl_hit],
                "prefix_query_tokens": [x for x in self._tl_query],
                "agent_window": [x for x in self._tl_window]}
