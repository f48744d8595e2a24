# The simulator's native engine: continuous batching on a virtual clock.
#
# A model of vLLM V1's step loop, driven by the same AdmissionCore the engine
# adapters use, with the core's BlockAllocator as the KV pool, as kvadmit's vLLM
# adapter runs it: before the step the running requests are put in the core's victim
# order (most protected first; admission order under lifo), a waiting request the
# core lets take KV from running ones displaces them (priority classes, flows) and
# the pause plan is made (both by the step planner, kvadmit._step_plan); then
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
# core's `arrive` returns its Rejection objects) and the progress callback. The
# requests, their blocks and prefix hashes, and the totals are EngineState's
# (kvadmit._engine_state).

from libc.math cimport INFINITY, isfinite
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._allocator cimport BlockAllocator
from kvadmit._core cimport AdmissionCore
from kvadmit._engine_state cimport EngineState, RQ_RUNNING, RQ_WAITING
from kvadmit._ledger cimport ST_WAITING
from kvadmit._session_hold cimport SessionHold
from kvadmit._step_plan cimport StepPlanner, prompt_need, watermark_beside


cdef enum:
    STEP_IDLE = 0
    STEP_RAN = 1
    STEP_PREEMPTED_ONLY = 2


cdef class NativeEngine(EngineState):
    """Continuous-batching engine model around an `AdmissionCore` (see the
    comment at the top of native/kvadmit/_native_engine.pyx). Build it, `add_requests`, `run`,
    then read `results()`, `totals()` and `timeline()`.

    Or step it on a clock a driver shares with other engines (a fleet): `start(t0)`,
    then `add_requests` (arrivals not before the last `advance`'s `until`) and
    `advance(until)` in turns, reading `signals()` and `take_rejections()` between
    them, and `drain()` at the end. The same requests added at the same times give
    the results `run` gives."""
    cdef readonly StepPlanner planner   # displacement and pauses, as kvadmit's vLLM adapter plans them
    cdef vector[int32_t] _order        # scratch: the core's victim order (slots)
    cdef int32_t _pinned               # the slot this step displaced for (it starts first), or -1

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
        self.session_hold = SessionHold()
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

    cdef void _plan_step(self, int64_t* budget) noexcept nogil:
        """kvadmit's side of the step (kvadmit._step_plan), as its vLLM adapter plans
        it. Displacement: the candidate's need and the blocks each of its victims
        frees; the displaced are preempted and the candidate starts first (`_pinned`).
        Pauses: per running request what it would compute (as the loop below takes
        it), its KV, blocks, priority, slot and, in a priced step, the blocks its
        preemption frees; the paused skip this step."""
        cdef int64_t hits, fresh, n, freed, kept
        cdef int64_t* rows
        cdef size_t i, j, nr = self._running.size()
        cdef int32_t s = self.planner.c_candidate(self.allocator.c_num_free(), False), r, v, b
        self._pinned = -1
        if s >= 0:
            r = self._slot_req[s]
            self.planner.need = self._prompt_need(r, self._prompt[r] + self._gen[r], budget[0],
                                                  &hits, &fresh, &n)
            if self.planner.c_short(self.allocator.c_num_free(), nr) and self.planner.c_victims():
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
            rows[4 * nr + i] = self._slot[r]
            rows[5 * nr + i] = rows[2 * nr + i]
        if self._prefix and self.planner.c_priced(self.allocator.c_num_free(), self._budget):
            for i in range(nr):   # a victim frees only the blocks no other request shares
                rows[5 * nr + i] = self._freed_blocks(self._running[i])
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
        self._demote_sessions(False)   # holds run out since the last step (an idle engine jumps its clock)
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
            if self._rec[r].session >= 0 and self._sess_shared.count(self._rec[r].session) == 0:
                self._sess_shared[self._rec[r].session] = hits   # others' content: never demoted
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
        self._demote_sessions()
        self._sample_timeline()

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
            # Only requests of sessions outside a full agent window wait: let the window
            # catch up with now (a change due already: step again), else sleep until it
            # changes (or the next arrival, if sooner), then step again.
            if self._running.empty() and self.core.c_num_waiting() > 0:
                before = (self.core.agent_window.c_active(), self.core.agent_window.c_size())
                self.core.expire_sessions(self._clock)
                self._demote_sessions()
                if (self.core.agent_window.c_active(), self.core.agent_window.c_size()) != before:
                    continue
                t = self.core.agent_window.c_next_change()
                if t < INFINITY and t <= self._next_arrival() and t > self._clock:
                    if t >= until:
                        self._clock = max(self._clock, until)
                        return False
                    self._clock = t
                    self.core.expire_sessions(self._clock)
                    self._demote_sessions()
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
