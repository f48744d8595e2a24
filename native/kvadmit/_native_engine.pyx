# The simulator's native engine: continuous batching on a virtual clock.
#
# A model of vLLM V1's step loop, driven by the same AdmissionCore the engine
# adapters use, with the core's BlockAllocator as the KV pool, as kvadmit's vLLM
# adapter runs it: before the step the running requests are put in the core's victim
# order (most protected first; admission order under lifo), a waiting request the
# core lets take KV from running ones displaces them (priority classes, flows) and
# the pause plan is made; then
#   1. running requests first, in that order: a decode takes 1 token, an
#      unfinished (chunked) prefill the rest of its prompt up to the step's token
#      budget; a request whose blocks do not fit preempts the core's victim
#      (recompute: blocks go back, with their prefix hashes, and the request waits
#      again at its arrival position), possibly itself;
#   2. if nothing was preempted, waiting requests in the core's order while the
#      core admits them, the budget lasts, `max_num_seqs` allows and the blocks
#      of their whole input (vLLM's default; or of the first chunk only) fit,
#      prefix hits from the allocator's cache first;
#   3. the step takes T = a + b * (tokens in the batch) + c * (context of the
#      batch: computed tokens of every scheduled request after the step); a
#      request whose prompt (and output so far) is computed emits a token at the
#      step's end, and finishes at its real output length.
# Everything in the loop is native; Python is called only for arrivals (the
# core's `arrive` returns its Rejection objects) and the progress callback.

from cython.operator cimport dereference as deref
from libc.math cimport INFINITY, isfinite
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.pair cimport pair
from libcpp.queue cimport priority_queue
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._allocator cimport BlockAllocator
from kvadmit._arrival cimport ArrivalRecord
from kvadmit._arrival_gate cimport ArrivalResult, Rejection
from kvadmit._core cimport AdmissionCore
from kvadmit._curves cimport cdiv
from kvadmit._ledger cimport ST_WAITING
from kvadmit._requests cimport Requests
from kvadmit._step_plan cimport StepPlanner, prompt_need, watermark_beside

from kvadmit._arrival_gate import REJECT_REASONS


cdef enum:
    RQ_PENDING = 0
    RQ_WAITING = 1
    RQ_RUNNING = 2
    RQ_DONE = 3
    RQ_REJECTED = 4

cdef enum:
    STEP_IDLE = 0
    STEP_RAN = 1
    STEP_PREEMPTED_ONLY = 2

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


cdef class NativeEngine:
    """Continuous-batching engine model around an `AdmissionCore` (see the
    comment at the top of native/kvadmit/_native_engine.pyx). Build it, `add_requests`, `run`,
    then read `results()`, `totals()` and `timeline()`.

    Or step it on a clock a driver shares with other engines (a fleet): `start(t0)`,
    then `add_requests` (arrivals not before the last `advance`'s `until`) and
    `advance(until)` in turns, reading `signals()` and `take_rejections()` between
    them, and `drain()` at the end. The same requests added at the same times give
    the results `run` gives."""
    cdef readonly AdmissionCore core
    cdef readonly BlockAllocator allocator
    cdef readonly StepPlanner planner   # displacement and pauses, as kvadmit's vLLM adapter plans them
    cdef int64_t _bs, _nblocks, _max_seqs, _max_active, _budget, _hash_block, _watermark
    cdef bint _chunked, _prefix, _full_input
    # vLLM's --scheduling-policy priority: vLLM keeps its running order and picks its
    # own victim (the largest priority value, then the latest arrival)
    cdef bint _vllm_priority
    cdef double _step_a_s, _step_b_s, _step_c_s, _sample_dt
    # requests, by index in arrival order
    cdef vector[double] _arr
    cdef vector[ArrivalRecord] _rec     # what the core gets at each arrival
    cdef vector[int64_t] _prompt, _out, _hoff, _hids, _hashed, _parent
    cdef vector[double] _delay
    cdef vector[int64_t] _open          # indexes of requests with a fixed arrival time
    cdef priority_queue[pair[double, int64_t]] _released   # (-time, -index): children due
    cdef vector[int64_t] _computed, _gen, _maxcomp, _sched
    cdef vector[int32_t] _slot, _npre
    cdef vector[char] _rstate
    cdef vector[int32_t] _reason
    cdef vector[double] _t_first, _t_done
    cdef vector[vector[int32_t]] _blocks
    cdef vector[vector[uint64_t]] _hashes
    cdef vector[vector[int64_t]] _children
    cdef unordered_map[int64_t, vector[pair[int32_t, uint64_t]]] _sess_blocks
    cdef vector[int32_t] _slot_req, _running, _scheduled
    cdef vector[int32_t] _hit_ids      # the admission candidate's prefix-cache hit blocks
    cdef vector[int32_t] _order        # scratch: the core's victim order (slots)
    cdef int32_t _pinned               # the slot this step displaced for (it starts first), or -1
    cdef vector[int32_t] _paused_reqs  # the requests paused this step
    cdef vector[char] _is_paused       # per request
    cdef vector[int64_t] _paused_sessions   # sessions the agent window paused (scratch)
    cdef int64_t _next                  # position in _open
    cdef bint _ran, _stepping
    cdef double _horizon                # stepping: no step starts at or after it yet
    cdef vector[double] _retry          # per request: the rejection's Retry-After (-1: none)
    cdef vector[int32_t] _rej_log       # rejected requests, in order
    cdef size_t _rej_taken              # how many of them take_rejections() returned
    # totals
    cdef double _clock, _t0, _kv_block_s, _busy_s, _next_sample
    cdef int64_t _steps, _preemptions, _recomputed, _out_tokens, _prefill_tokens
    cdef int64_t _hit_tokens, _query_tokens, _peak_used, _held_blocks, _batch_tokens
    cdef int64_t _n_done, _n_rejected
    cdef vector[double] _tl_t
    cdef vector[int64_t] _tl_used, _tl_running, _tl_waiting, _tl_preempt, _tl_hit, _tl_query
    cdef vector[double] _tl_window
    cdef int64_t _step_hit, _step_query

    def __init__(self, config, int64_t num_blocks, int64_t block_size, int64_t max_model_len,
                 int64_t max_num_seqs, int64_t max_num_batched_tokens, bint chunked_prefill=True,
                 bint prefix_caching=False, double step_a=0.0, double step_b=0.0,
                 double step_c=0.0, int64_t hash_block_tokens=0, double sample_interval_s=1.0,
                 bint reserve_full_input=True, int64_t watermark_blocks=0,
                 int64_t max_num_active_seqs=0, bint vllm_priority_policy=False):
        from kvadmit.vllm.fit import fit_to_vllm
        # The config as kvadmit's vLLM scheduler runs it on an engine of this shape. The
        # core checks the pool's numbers first (the checks below divide by block_size).
        config = fit_to_vllm(config, chunked_prefill=chunked_prefill,
                             max_num_batched_tokens=max_num_batched_tokens,
                             priority_scheduling=vllm_priority_policy)
        self.core = AdmissionCore(config, num_blocks, block_size, max_model_len)
        self.allocator = BlockAllocator(num_blocks)
        self._pinned = -1
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}: must be >= 1")
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 1")
        if not 0 <= watermark_blocks < num_blocks:
            raise ValueError(f"watermark_blocks={watermark_blocks}: must be in [0, num_blocks={num_blocks})")
        if not 0 <= max_num_active_seqs <= max_num_seqs:
            raise ValueError(f"max_num_active_seqs={max_num_active_seqs}: must be in "
                             f"[0, max_num_seqs={max_num_seqs}] (0: max_num_seqs)")
        if not chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens}: without chunked prefill it must "
                f"be >= max_model_len={max_model_len}, or a long prompt never fits a step")
        for name, v in (("step_a", step_a), ("step_b", step_b), ("step_c", step_c)):
            if not (isfinite(v) and v >= 0.0):
                raise ValueError(f"{name}={v}: must be a finite number >= 0 (seconds)")
        if step_a + step_b <= 0.0:
            raise ValueError("step_a + step_b must be > 0, or the virtual clock never advances")
        if hash_block_tokens < 0 or (hash_block_tokens and hash_block_tokens % block_size):
            raise ValueError(f"hash_block_tokens={hash_block_tokens}: must be 0 or a multiple of "
                             f"block_size={block_size}")
        if not (isfinite(sample_interval_s) and sample_interval_s > 0):
            raise ValueError(f"sample_interval_s={sample_interval_s}: must be > 0")
        self._bs = block_size
        self._nblocks = num_blocks
        self._max_seqs = max_num_seqs
        self._max_active = max_num_active_seqs if max_num_active_seqs > 0 else max_num_seqs
        self._watermark = watermark_blocks
        self.planner = StepPlanner(self.core, watermark_blocks, 0)
        self._vllm_priority = vllm_priority_policy
        self._budget = max_num_batched_tokens
        self._chunked = chunked_prefill
        self._prefix = prefix_caching
        self._full_input = reserve_full_input
        self._step_a_s, self._step_b_s, self._step_c_s = step_a, step_b, step_c
        self._hash_block = hash_block_tokens
        self._sample_dt = sample_interval_s
        self._hoff.push_back(0)
        self._ran = False
        self.core.set_step_budget(max_num_batched_tokens)
        self.core.counts_shared_prefix = True     # every admission reports set_shared

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

    cdef void _demote_paused(self) noexcept nogil:
        """The prefixes of sessions the agent window paused go to the front of the
        free queue: still reusable, evicted before active sessions' (CONCUR)."""
        cdef size_t i, j
        cdef unordered_map[int64_t, vector[pair[int32_t, uint64_t]]].iterator it
        self._paused_sessions.clear()
        self.core.agent_window.c_take_paused(self._paused_sessions)
        for i in range(self._paused_sessions.size()):
            it = self._sess_blocks.find(self._paused_sessions[i])
            if it == self._sess_blocks.end():
                continue
            # tail first, so the session's first block ends up taken last
            j = deref(it).second.size()
            while j > 0:
                j -= 1
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

    cdef size_t _preempt(self, int32_t v, int64_t* budget, bint displaced) noexcept nogil:
        """Preempts v (recompute; `displaced`: for a waiting request, see
        `_plan_step`); returns its index in the running list before."""
        if self._sched[v] > 0:
            budget[0] += self._sched[v]
            self._sched[v] = 0
        self._release_blocks(v)
        self.core.c_preempt(self._slot[v], self._clock, displaced)
        self._computed[v] = 0
        self._npre[v] += 1
        self._rstate[v] = RQ_WAITING
        self._preemptions += 1
        return self._running_erase(v)

    cdef void _finish(self, int32_t r, double t) noexcept nogil:
        self.core.c_finish(self._slot[r], t)
        cdef size_t i
        cdef int32_t b
        cdef uint64_t h
        if self._prefix and self._rec[r].session >= 0 and self.core.agent_window.enabled:
            # The session's context so far, for demotion if it is paused later.
            self._sess_blocks[self._rec[r].session].clear()
            for i in range(self._blocks[r].size()):
                b = self._blocks[r][i]
                if self.allocator.c_held_hash(b, &h):
                    self._sess_blocks[self._rec[r].session].push_back(pair[int32_t, uint64_t](b, h))
        self._release_blocks(r)
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

    cdef void _plan_step(self, int64_t* budget) noexcept nogil:
        """kvadmit's side of the step (kvadmit._step_plan), as its vLLM adapter plans
        it. Displacement: the candidate's need and the blocks each of its victims
        frees; the displaced are preempted and the candidate starts first (`_pinned`).
        Pauses: per running request what it would compute (as the loop below takes
        it), its KV, blocks and priority; the paused skip this step."""
        cdef int64_t hits, fresh, n, freed, kept
        cdef int64_t* rows
        cdef size_t i, j, nr = self._running.size()
        cdef int32_t s = self.planner.c_candidate(self.allocator.c_num_free()), r, v, b
        self._pinned = -1
        if s >= 0:
            r = self._slot_req[s]
            self.planner.need = self._prompt_need(r, self._prompt[r] + self._gen[r], budget[0],
                                                  &hits, &fresh, &n)
            if self.planner.c_short(self.allocator.c_num_free(), nr):
                for i in range(self.planner.victims.size()):
                    v = self._slot_req[self.planner.victims[i]]
                    freed = kept = 0
                    for j in range(self._blocks[v].size()):
                        b = self._blocks[v][j]
                        if self.allocator.c_ref_count(b) == 1:
                            freed += 1
                            kept += self._is_hit(b)
                    self.planner.freed[i], self.planner.kept[i] = freed, kept
                if self.planner.c_displace(self.allocator.c_num_free(), nr):
                    for i in range(self.planner.displaced.size()):
                        self._preempt(self._slot_req[self.planner.displaced[i]], budget, True)
                    self._pinned = s
        if not self.core.c_pauses_on_shortfall():
            return
        nr = self._running.size()
        rows = self.planner.c_rows(nr)
        for i in range(nr):
            r = self._running[i]
            rows[i] = self._prompt[r] + self._gen[r] - self._computed[r]
            rows[nr + i] = self._computed[r]
            rows[2 * nr + i] = self._blocks[r].size()
            rows[3 * nr + i] = self._rec[r].priority
        if self.planner.c_pause(self.allocator.c_num_free(), self._budget):
            for i in range(nr):
                if self.planner.paused[i]:
                    r = self._running[i]
                    self._is_paused[r] = 1
                    self._paused_reqs.push_back(r)

    cdef int _step(self) noexcept nogil:
        """One engine step: STEP_RAN, STEP_PREEMPTED_ONLY (every scheduled request
        was preempted: try again at the same time) or STEP_IDLE (nothing to run)."""
        cdef int64_t budget = self._budget
        self._scheduled.clear()
        self._order_running()
        self._plan_step(&budget)
        cdef bint preempted = self._schedule_running(&budget)
        # Waiting requests only in a step without preemption (as vLLM); the core
        # admits none in a step with paused requests.
        if not preempted:
            self._schedule_waiting(&budget)
        if self._scheduled.empty():
            return STEP_PREEMPTED_ONLY if preempted else STEP_IDLE
        self._run_scheduled()
        return STEP_RAN

    cdef void _order_running(self) noexcept nogil:
        """The running list in the core's victim order, most protected first, as
        kvadmit's vLLM adapter puts vLLM's before each step: the step serves them in
        that order and the pause plan reads it. Admission order under lifo, unless
        priority classes or flows over their share move a request back."""
        if self._vllm_priority:
            return                # vLLM's priority scheduling keeps its own order
        if not self.core.c_victim_order(self._order) or self._order.size() != self._running.size():
            return
        cdef size_t i
        for i in range(self._order.size()):
            self._running[i] = self._slot_req[self._order[i]]

    cdef int32_t _priority_victim(self) noexcept nogil:
        """vLLM's victim under its priority scheduling: the running request with the
        largest (priority, arrival time), the later of equal ones (vLLM stamps its
        arrivals in the order they come)."""
        cdef int32_t r, best = self._running[0]
        cdef size_t i
        for i in range(1, self._running.size()):
            r = self._running[i]
            if self._rec[r].priority > self._rec[best].priority or (
                    self._rec[r].priority == self._rec[best].priority
                    and (self._arr[r] > self._arr[best]
                         or (self._arr[r] == self._arr[best] and r > best))):
                best = r
        return best

    cdef bint _schedule_running(self, int64_t* budget) noexcept nogil:
        """1. Running requests, in the core's victim order, take their tokens from the
        budget; one whose blocks do not fit preempts the core's victims until they
        do (or it is the victim). True if anything was preempted."""
        cdef size_t i = 0, k
        cdef int32_t r, v
        cdef int64_t n
        cdef bint preempted = False
        while i < self._running.size() and budget[0] > 0:
            r = self._running[i]
            if self._is_paused[r]:
                i += 1            # paused: keeps its KV, skips this step
                continue
            n = self._prompt[r] + self._gen[r] - self._computed[r]
            if n > budget[0]:
                n = budget[0]
            while not self._grow(r, self._computed[r] + n):
                v = self._priority_victim() if self._vllm_priority \
                    else self._slot_req[self.core.c_victim()]
                if self._preempt(v, budget, False) < i:
                    i -= 1        # an earlier, already scheduled request went
                preempted = True
                if v == r:
                    break
            if self._rstate[r] != RQ_RUNNING:
                # r itself was the victim. Under FCFS it is the last; under vLLM's
                # priority scheduling the later ones are more important and may still
                # fit: vLLM 0.33 schedules them (0.32 ended the loop here)
                continue
            self._sched[r] = n
            self._scheduled.push_back(r)
            budget[0] -= n
            i += 1
        for k in range(self._paused_reqs.size()):
            self._is_paused[self._paused_reqs[k]] = 0
        self._paused_reqs.clear()
        return preempted

    cdef bint _is_hit(self, int32_t b) noexcept nogil:
        """Whether block b is one of the admission candidate's prefix hits (`_hit_ids`)."""
        cdef size_t i
        for i in range(self._hit_ids.size()):
            if self._hit_ids[i] == b:
                return True
        return False

    cdef int64_t _prompt_need(self, int32_t r, int64_t tokens, int64_t budget, int64_t* hits,
                              int64_t* fresh, int64_t* n) noexcept nogil:
        """The free blocks waiting request r (`tokens` of input) takes if it starts now
        with `budget` tokens left: its prefix hits (`hits`, `_hit_ids`) on cached-free
        blocks (`fresh`: touching one takes it from the free pool) and the blocks of
        its uncached tokens; `n` of those it computes this step. vLLM 0.32
        (scheduler_reserve_full_isl, on by default) admits only if the whole input
        fits now, though it allocates for the first chunk only."""
        hits[0] = self._prefix_hit_blocks(r, tokens, fresh) if self._prefix else 0
        if not self._prefix:
            fresh[0] = 0
        n[0] = tokens - hits[0] * self._bs
        if n[0] > budget and self._chunked:
            n[0] = budget
        return prompt_need(tokens, 0, hits[0], fresh[0],
                           budget if self._chunked and not self._full_input else tokens,
                           0, self._bs)

    cdef void _schedule_waiting(self, int64_t* budget) noexcept nogil:
        """2. Waiting requests in the core's order (the one this step displaced for
        first) while the core admits them, the budget lasts, max_num_seqs allows and
        their blocks fit (prefix hits first)."""
        cdef int64_t n, tokens, hits, fresh, j, c0, need
        cdef int32_t r, s, b
        while budget[0] > 0:
            if self._pinned >= 0 and self.core.ledger.state(self._pinned) == ST_WAITING:
                s = self._pinned      # the one this step displaced for
            else:
                # vLLM looks at its waiting queue (the core's scan) before it checks
                # max_num_seqs: the scan's holds count (a held request saturates the
                # pool, and sheddable ones are shed) even when no request may start.
                s = self.core.c_next_admissible(self.allocator.c_num_free(), False)
            self._pinned = -1
            if s < 0 or <int64_t>self._running.size() >= self._max_active:
                break
            r = self._slot_req[s]
            tokens = self._prompt[r] + self._gen[r]
            need = self._prompt_need(r, tokens, budget[0], &hits, &fresh, &n) \
                + watermark_beside(self._watermark, self._running.size())
            c0 = hits * self._bs
            if n > budget[0]:
                break                 # no chunked prefill: the whole prompt waits for a step
            if need > self.allocator.c_num_free():
                self._held_blocks += 1
                break
            for j in range(hits):
                b = self._hit_ids[j]
                self.allocator.c_share(b)
                self._blocks[r].push_back(b)
            self._grow(r, c0 + n)
            self._hit_tokens += c0
            self._query_tokens += tokens
            self._step_hit += c0
            self._step_query += tokens
            self._computed[r] = c0
            # hits on blocks other requests hold (not the cached-free ones it takes over)
            self.core.c_set_shared(s, (hits - fresh) * self._bs)
            self.core.c_admit(s, self._clock)
            self._rstate[r] = RQ_RUNNING
            self._running.push_back(r)
            self._sched[r] = n
            self._scheduled.push_back(r)
            budget[0] -= n

    cdef void _run_scheduled(self) noexcept nogil:
        """3. The step: its time from the batch's tokens and context; the core hears
        of the step as scheduled; each scheduled request computes its tokens, emits one
        when its input is all computed and finishes at its real length."""
        cdef int64_t n, c0, c1, j, ctx = 0, batch = 0
        cdef size_t k
        cdef int32_t r
        for k in range(self._scheduled.size()):
            r = self._scheduled[k]
            if self._sched[r] > 0:
                batch += self._sched[r]
                ctx += self._computed[r] + self._sched[r]
        cdef double dt = self._step_a_s + self._step_b_s * batch + self._step_c_s * ctx
        cdef double t_start = self._clock, t_end = self._clock + dt
        cdef int64_t used = self._nblocks - self.allocator.c_num_free()
        if used > self._peak_used:
            self._peak_used = used
        self._kv_block_s += used * dt
        self._busy_s += dt
        self._batch_tokens += batch
        # The core's step sequence (AdmissionCore.step_done / step), as kvadmit's vLLM
        # adapter runs it: the step is scheduled (done, at its start time and with its
        # known time dt: its running requests at their progress before it); its tokens
        # then run and its finishes are reported; the next step starts at its end (the
        # blocks in use after the finishes, the progress reported as it ran), before
        # that instant's arrivals.
        self.core.c_step_done(batch, ctx, t_start, self._step_hit, self._step_query, dt)
        for k in range(self._scheduled.size()):
            r = self._scheduled[k]
            n = self._sched[r]
            if n == 0:
                continue     # preempted after being scheduled
            self._sched[r] = 0
            c0 = self._computed[r]
            c1 = c0 + n
            if c0 < self._maxcomp[r]:
                self._recomputed += (c1 if c1 < self._maxcomp[r] else self._maxcomp[r]) - c0
            if c1 > self._maxcomp[r]:
                self._maxcomp[r] = c1
            if c0 < self._prompt[r]:
                self._prefill_tokens += (c1 if c1 < self._prompt[r] else self._prompt[r]) - c0
            self._computed[r] = c1
            if self._prefix:
                for j in range(c0 // self._bs, c1 // self._bs):
                    self.allocator.c_cache(self._blocks[r][j], self._block_hash(r, j))
            if c1 == self._prompt[r] + self._gen[r]:
                self._gen[r] += 1
                self._out_tokens += 1
                if self._t_first[r] < 0:
                    self._t_first[r] = t_end
            self.core.c_progress(self._slot[r], self._computed[r], self._gen[r])
            if self._gen[r] >= self._out[r]:
                self._running_erase(r)
                self._finish(r, t_end)
        self._clock = t_end
        self._steps += 1
        used = self._nblocks - self.allocator.c_num_free()
        self.core.c_step(t_end, used, NULL, 0, True)
        self._step_hit = self._step_query = 0
        self._demote_paused()
        self._sample_timeline()

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

    def run(self, progress=None, int64_t progress_every=10000):
        """Replays every request to completion or rejection. ``progress(done,
        total)`` is called every `progress_every` steps."""
        if self._stepping:
            raise RuntimeError("run after start: a stepped engine ends with drain()")
        if self._ran:
            raise RuntimeError("run() twice")
        self._ran = True
        cdef int64_t total = self._arr.size()
        if total == 0:
            return
        if self._open.empty():
            raise ValueError("no request has a fixed arrival time (every one has a parent)")
        self._clock = self._t0 = self._arr[self._open[0]]
        self._next_sample = self._t0
        self._loop(INFINITY, progress, progress_every)
        if progress is not None:
            progress(self._n_done + self._n_rejected, total)
        self._check_idle()

    cdef bint _loop(self, double until, object progress, int64_t progress_every) except -1:
        """Steps until the clock reaches `until` (no step starts at or after it;
        an idle engine's clock moves to it) or, with nothing left to arrive, the
        engine is idle: True then."""
        cdef int64_t since = 0
        cdef int st
        cdef double t
        while True:
            if self._clock >= until:
                return False
            self._arrivals()
            st = self._step()
            if st == STEP_PREEMPTED_ONLY:
                continue
            if st == STEP_RAN:
                since += 1
                if progress is not None and since >= progress_every:
                    since = 0
                    progress(self._n_done + self._n_rejected, <int64_t>self._arr.size())
                continue
            # Only requests of sessions outside a full agent window wait: sleep until
            # an idle session leaves it (or the next arrival, if sooner).
            if self._running.empty() and self.core.c_num_waiting() > 0:
                t = self.core.agent_window.c_next_expiry()
                if t < INFINITY and t <= self._next_arrival():
                    if t >= until:
                        self._clock = max(self._clock, until)
                        return False
                    self._clock = max(self._clock, t)
                    before = self.core.agent_window.c_active()
                    self.core.expire_sessions(self._clock)
                    self._demote_paused()
                    if self.core.agent_window.c_active() < before:
                        continue
            if self._next_arrival() < INFINITY:
                if self._next_arrival() >= until:
                    self._clock = max(self._clock, until)
                    return False
                self._clock = max(self._clock, self._next_arrival())
                continue
            if self._running.empty() and self.core.c_num_waiting() == 0:
                if until < INFINITY:
                    self._clock = max(self._clock, until)
                return True
            raise RuntimeError(
                f"native engine stuck at t={self._clock:.3f}s: {self.core.c_num_waiting()} waiting, "
                f"{self._running.size()} running, {self.allocator.c_num_free()} free blocks, "
                f"nothing schedulable")

    cdef _check_idle(self):
        """At the end: every KV block back, every request finished or refused."""
        if self.allocator.c_num_free() != self._nblocks:
            raise AssertionError(f"leak: {self._nblocks - self.allocator.c_num_free()} blocks "
                                 f"still used at idle")
        cdef int64_t unanswered = <int64_t>self._arr.size() - self._n_done - self._n_rejected
        if unanswered != 0:
            raise AssertionError(f"{unanswered} requests neither finished nor refused at idle")

    # ------------------------------------------------------------------
    # Stepping: a driver's clock (several engines on one virtual clock)
    def start(self, double t0):
        """Starts the engine's clock at `t0` for stepping (instead of `run`)."""
        if self._ran:
            raise RuntimeError("start after run or start")
        if not isfinite(t0):
            raise ValueError(f"t0={t0}: must be finite")
        if not self._open.empty() and self._arr[self._open[0]] < t0:
            raise ValueError(f"t0={t0}: after the first arrival {self._arr[self._open[0]]}")
        self._ran = self._stepping = True
        self._clock = self._t0 = self._horizon = t0
        self._next_sample = t0

    def advance(self, double until):
        """Runs steps that start before `until` (the clock ends at or past it, at
        the end of the step that crosses it; an idle engine's clock moves to
        it). Requests added afterwards must not arrive before `until`. Returns
        True if the engine is idle with nothing left to arrive."""
        if not self._stepping:
            raise RuntimeError("advance before start")
        if not until >= self._horizon:
            raise ValueError(f"until={until}: before the last advance's until {self._horizon}")
        idle = self._loop(until, None, 0)
        self._horizon = until
        return idle

    def drain(self):
        """Steps until every request added is done or refused; checks that every
        KV block is back."""
        if not self._stepping:
            raise RuntimeError("drain before start")
        self._loop(INFINITY, None, 0)
        self._horizon = max(self._horizon, self._clock)
        self._check_idle()

    @property
    def clock(self):
        return self._clock

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
