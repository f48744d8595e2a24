# The request ledger's C-level API (see _ledger.pyx). Its per-request arrays are
# private: other modules read them through the inline getters below and change
# them only through the ledger's transitions (add, enqueue, dequeue, start,
# preempt, cancel_start, finish, release, ...), which keep the sums in step.
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.vector cimport vector

from kvadmit._arrival cimport ArrivalRecord
from kvadmit._curves cimport cdiv

cdef inline bint less_important(int64_t r, int64_t p, int64_t margin) noexcept nogil:
    """Under queue_order "priority": whether priority value r is less important than p
    by more than `margin` (r - p > margin, computed without overflow). A waiting request
    of priority p takes KV only from running requests less important than it so
    (priority_preemption_threshold; 0: strictly lower)."""
    return r > p and <uint64_t>r - <uint64_t>p > <uint64_t>margin


cdef enum:  # indexes into STATES
    ST_FREE = 0
    ST_WAITING = 1
    ST_RUNNING = 2


cdef class Ledger:
    cdef readonly int64_t block_size
    cdef readonly int64_t prefill_chunk      # chunked-prefill tokens a step (0: unchunked)
    cdef int64_t _step                       # engine steps so far (next_step)
    cdef int64_t _seq                        # arrivals and admissions so far (one sequence)
    # per slot
    cdef vector[int64_t] _prompt, _cached, _computed, _generated, _max_new
    cdef vector[int64_t] _priority, _arrival, _admit_seq, _admit_step, _blocks, _pred_total
    cdef vector[int64_t] _shared     # prompt tokens in blocks other running requests hold (auto)
    cdef vector[int64_t] _held_step  # the step its last hold was counted in
    cdef vector[int64_t] _arrive_step   # the engine step it arrived in (its peers: the same)
    cdef vector[int64_t] _session    # its agent session (-1: none)
    cdef vector[int32_t] _bypassed, _preempts
    cdef vector[char] _state, _unstarted
    cdef vector[char] _sheddable     # its record's class: served after, and gives way to, all others
    cdef vector[char] _activated_by  # its admission activated its session
    cdef vector[double] _ttft, _tpot, _arrive_t
    cdef vector[double] _engine_t, _engine_tie   # the engine's arrival time and tie-break
    cdef vector[double] _expire_at   # when it is dropped if it has not started (INFINITY: never)
    cdef vector[ArrivalRecord] _rec  # its arrival record, whole (its ttl_s, prompt_hash, ...)
    cdef vector[int64_t] _flow       # its flow id (-1: none)
    cdef vector[int32_t] _flow_ix    # its flow's index in kvadmit._flows.FlowTable (0: no flow)
    # per flow index: requests live (waiting or running), waiting, and their prefill tokens
    cdef vector[int64_t] _f_live, _f_waiting, _f_queued
    # the running set, in no particular order, and its sums
    cdef vector[int32_t] _running
    cdef vector[int32_t] _run_pos    # per slot: its index in running (-1: not running)
    cdef int64_t _reserve_sum        # blocks for prompt + max_new over running (reserve's load)
    cdef int64_t _run_ctx            # tokens over running (the SLO guard's context)
    cdef int64_t _queued             # prefill tokens still to do over the queued (enqueued) requests
    cdef vector[int32_t] _free_slots
    cdef vector[int64_t] _rows       # check_rows' checked (slot, computed, generated) rows
    # finished requests' predicted against actual output lengths
    cdef int64_t _n_len_obs
    cdef double _len_abs_err, _len_pred_sum, _len_actual_sum

    # --- getters ----------------------------------------------------------
    cdef inline const int64_t* rows(self) noexcept nogil:
        """check_rows' last rows: (slot, computed, generated) each."""
        return self._rows.data()

    cdef inline int64_t step(self) noexcept nogil:
        return self._step
    cdef inline int64_t next_seq(self) noexcept nogil:
        """The arrival number the next request would get."""
        return self._seq
    cdef inline int64_t n_slots(self) noexcept nogil:
        return self._state.size()
    cdef inline int state(self, int32_t s) noexcept nogil:
        return self._state[s]
    cdef inline int64_t prompt(self, int32_t s) noexcept nogil:
        return self._prompt[s]
    cdef inline int64_t cached(self, int32_t s) noexcept nogil:
        return self._cached[s]
    cdef inline int64_t computed(self, int32_t s) noexcept nogil:
        return self._computed[s]
    cdef inline int64_t generated(self, int32_t s) noexcept nogil:
        return self._generated[s]
    cdef inline int64_t max_new(self, int32_t s) noexcept nogil:
        return self._max_new[s]
    cdef inline int64_t priority(self, int32_t s) noexcept nogil:
        return self._priority[s]
    cdef inline int64_t arrival(self, int32_t s) noexcept nogil:
        return self._arrival[s]
    cdef inline int64_t admit_seq(self, int32_t s) noexcept nogil:
        return self._admit_seq[s]
    cdef inline int64_t admit_step(self, int32_t s) noexcept nogil:
        return self._admit_step[s]
    cdef inline int64_t arrive_step(self, int32_t s) noexcept nogil:
        return self._arrive_step[s]
    cdef inline int64_t pred_total(self, int32_t s) noexcept nogil:
        return self._pred_total[s]
    cdef inline int64_t shared(self, int32_t s) noexcept nogil:
        return self._shared[s]
    cdef inline int64_t session(self, int32_t s) noexcept nogil:
        return self._session[s]
    cdef inline int64_t prompt_hash(self, int32_t s) noexcept nogil:
        return self._rec[s].prompt_hash
    cdef inline int32_t bypassed(self, int32_t s) noexcept nogil:
        return self._bypassed[s]
    cdef inline int32_t preempts(self, int32_t s) noexcept nogil:
        """Times s was preempted (its KV recomputed)."""
        return self._preempts[s]
    cdef inline bint unstarted(self, int32_t s) noexcept nogil:
        """Waiting and never admitted: shedding and its TTL may drop it."""
        return self._unstarted[s]
    cdef inline bint sheddable(self, int32_t s) noexcept nogil:
        return self._sheddable[s]
    cdef inline bint ranks_below(self, int32_t r, int32_t s, int64_t margin) noexcept nogil:
        """Whether r is less important than s, so s may take its KV or its queue
        place: r sheddable and s not, else (the same class) r's priority value larger
        than s's by more than `margin` (see less_important)."""
        if self._sheddable[r] != self._sheddable[s]:
            return self._sheddable[r]
        return less_important(self._priority[r], self._priority[s], margin)
    cdef inline bint activated_by(self, int32_t s) noexcept nogil:
        return self._activated_by[s]
    cdef inline double ttft(self, int32_t s) noexcept nogil:
        return self._ttft[s]
    cdef inline double tpot(self, int32_t s) noexcept nogil:
        return self._tpot[s]
    cdef inline double arrive_t(self, int32_t s) noexcept nogil:
        return self._arrive_t[s]
    cdef inline double engine_t(self, int32_t s) noexcept nogil:
        return self._engine_t[s]
    cdef inline double engine_tie(self, int32_t s) noexcept nogil:
        return self._engine_tie[s]
    cdef inline double expire_at(self, int32_t s) noexcept nogil:
        return self._expire_at[s]
    cdef inline double ttl_s(self, int32_t s) noexcept nogil:
        return self._rec[s].ttl_s
    cdef inline const ArrivalRecord* record(self, int32_t s) noexcept nogil:
        """s's arrival record as it arrived."""
        return &self._rec[s]
    cdef inline int64_t flow(self, int32_t s) noexcept nogil:
        return self._flow[s]
    cdef inline int32_t flow_ix(self, int32_t s) noexcept nogil:
        return self._flow_ix[s]
    cdef inline int64_t flow_live(self, int32_t f) noexcept nogil:
        return self._f_live[f]
    cdef inline int64_t flow_waiting(self, int32_t f) noexcept nogil:
        return self._f_waiting[f]
    cdef inline int64_t flow_queued(self, int32_t f) noexcept nogil:
        return self._f_queued[f]
    cdef inline int64_t n_flows(self) noexcept nogil:
        return self._f_live.size()
    cdef inline void add_flow(self) noexcept nogil:
        """Room for one more flow index (kvadmit._flows.FlowTable assigns them)."""
        self._f_live.push_back(0)
        self._f_waiting.push_back(0)
        self._f_queued.push_back(0)
    cdef inline int64_t held_blocks(self, int32_t s) noexcept nogil:
        """KV blocks a request's tokens so far fill (the fair share's cost unit)."""
        return cdiv(self.tokens(s), self.block_size)
    cdef inline int64_t n_running(self) noexcept nogil:
        return self._running.size()
    cdef inline int32_t running_at(self, size_t i) noexcept nogil:
        return self._running[i]
    cdef inline int64_t reserve_load(self) noexcept nogil:
        return self._reserve_sum
    cdef inline int64_t running_context(self) noexcept nogil:
        return self._run_ctx
    cdef inline int64_t queued_tokens(self) noexcept nogil:
        return self._queued

    cdef inline int64_t tokens(self, int32_t s) noexcept nogil:
        """KV tokens a request needs to run its next step: prompt plus output so far."""
        return self._prompt[s] + self._generated[s]

    cdef inline int64_t worst_steps(self, int32_t s) noexcept nogil:
        """Decode steps left if it runs to its max_tokens (at least 1)."""
        cdef int64_t r = self._max_new[s] - self._generated[s]
        return r if r > 1 else 1

    cdef inline int64_t prefill_extra_steps(self, int32_t s) noexcept nogil:
        """Steps a chunked prefill adds before decoding starts (0 when unchunked)."""
        if self.prefill_chunk <= 0:
            return 0
        cdef int64_t todo = self.tokens(s) - self._computed[s]
        if todo <= self.prefill_chunk:
            return 0
        return cdiv(todo, self.prefill_chunk) - 1

    cdef inline int64_t reserve_blocks(self, int32_t s) noexcept nogil:
        return cdiv(self._prompt[s] + self._max_new[s], self.block_size)

    cdef inline int64_t queued_of(self, int32_t s) noexcept nogil:
        """Tokens a waiting request still has to prefill."""
        cdef int64_t q = self.tokens(s) - self._cached[s]
        return q if q > 0 else 0

    cdef inline int check_live(self, int64_t s) except -1:
        """A slot that holds a request (waiting or running)."""
        if s < 0 or s >= <int64_t>self._state.size() or self._state[s] == ST_FREE:
            raise KeyError(f"slot {s} is not a live request")
        return 0

    # --- transitions ------------------------------------------------------
    cdef inline void set_counts(self, int32_t s, int64_t computed, int64_t generated) noexcept nogil:
        """The engine's counts for s: tokens with KV computed, tokens generated (the
        queued sum follows a waiting request's, the running context a running one's)."""
        cdef int64_t before = self.queued_of(s)
        if self._state[s] == ST_WAITING:
            self._computed[s] = computed
            self._generated[s] = generated
            self._queued += self.queued_of(s) - before
            self._f_queued[self._flow_ix[s]] += self.queued_of(s) - before
            return
        self._computed[s] = computed
        self._run_ctx += generated - self._generated[s]
        self._generated[s] = generated

    cdef inline void next_step(self) noexcept nogil:
        self._step += 1

    cdef inline bint note_held(self, int32_t s) noexcept nogil:
        """Whether s's hold is the first counted in this step (and marks it counted)."""
        if self._held_step[s] == self._step:
            return False
        self._held_step[s] = self._step
        return True

    cdef inline void bypass(self, int32_t s) noexcept nogil:
        """A later request was admitted ahead of the waiting s."""
        self._bypassed[s] += 1

    cdef inline void set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil:
        self._shared[s] = shared_tokens

    cdef inline void set_blocks(self, int32_t s, int64_t blocks) noexcept nogil:
        self._blocks[s] = blocks

    cdef inline void set_prediction(self, int32_t s, int64_t total) noexcept nogil:
        """Its predicted output length, for the length-error stats."""
        self._pred_total[s] = total

    cdef int32_t add(self, const ArrivalRecord* r, double ttft, double tpot, double arrive_t,
                     int64_t session, double expire_at, int32_t flow_ix)
    cdef void enqueue(self, int32_t s, bint unstarted) noexcept nogil
    cdef void dequeue(self, int32_t s) noexcept nogil
    cdef void start(self, int32_t s, bint activated) noexcept nogil
    cdef void stop(self, int32_t s) noexcept nogil
    cdef void preempt(self, int32_t s) noexcept nogil
    cdef bint cancel_start(self, int32_t s) noexcept nogil
    cdef void finish(self, int32_t s) noexcept nogil
    cdef void release(self, int32_t s) noexcept nogil
    cdef void set_cached(self, int32_t s, int64_t cached_tokens) noexcept nogil
    cdef int check_state(self, int64_t s, int want) except -1
    cdef int check_counts(self, int64_t s, int64_t computed, int64_t generated) except -1
    cdef Py_ssize_t check_rows(self, slots, computed_tokens, generated_tokens,
                               str caller) except -1
    cdef bint apply_rows(self, const int64_t* rows, Py_ssize_t n) noexcept nogil
    cdef bint update_many(self, slots, computed_tokens, generated_tokens) except -1
