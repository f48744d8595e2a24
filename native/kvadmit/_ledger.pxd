# The request ledger's C-level API (see _ledger.pyx). Its per-request arrays are
# public: the core writes them, the policies read them.
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._curves cimport cdiv

cdef enum:  # indexes into STATES
    ST_FREE = 0
    ST_WAITING = 1
    ST_RUNNING = 2


cdef class Ledger:
    cdef readonly int64_t block_size
    cdef readonly int64_t prefill_chunk      # chunked-prefill tokens a step (0: unchunked)
    cdef int64_t step                        # engine steps so far (on_step)
    # per slot
    cdef vector[int64_t] prompt, cached, computed, generated, max_new
    cdef vector[int64_t] priority, arrival, admit_seq, admit_step, blocks, pred_total
    cdef vector[int64_t] shared      # prompt tokens in blocks other running requests hold (auto)
    cdef vector[int64_t] held_step   # the step its last hold was counted in
    cdef vector[int64_t] session     # its agent session (-1: none)
    cdef vector[int32_t] bypassed, preempts
    cdef vector[char] state, sheddable
    cdef vector[char] activated_by   # its admission activated its session
    cdef vector[double] ttft, tpot, arrive_t
    cdef vector[double] engine_t, engine_tie   # the engine's arrival time and tie-break
    # the running set, in no particular order, and its sums
    cdef vector[int32_t] running
    cdef vector[int32_t] _run_pos    # per slot: its index in running (-1: not running)
    cdef int64_t reserve_sum         # blocks for prompt + max_new over running (reserve's load)
    cdef int64_t run_ctx             # tokens over running (the SLO guard's context)
    cdef vector[int32_t] _free_slots

    cdef inline int64_t tokens(self, int32_t s) noexcept nogil:
        """KV tokens a request needs to run its next step: prompt plus output so far."""
        return self.prompt[s] + self.generated[s]

    cdef inline int64_t worst_steps(self, int32_t s) noexcept nogil:
        """Decode steps left if it runs to its max_tokens (at least 1)."""
        cdef int64_t r = self.max_new[s] - self.generated[s]
        return r if r > 1 else 1

    cdef inline int64_t prefill_extra_steps(self, int32_t s) noexcept nogil:
        """Steps a chunked prefill adds before decoding starts (0 when unchunked)."""
        if self.prefill_chunk <= 0:
            return 0
        cdef int64_t todo = self.tokens(s) - self.computed[s]
        if todo <= self.prefill_chunk:
            return 0
        return cdiv(todo, self.prefill_chunk) - 1

    cdef inline int64_t reserve_blocks(self, int32_t s) noexcept nogil:
        return cdiv(self.prompt[s] + self.max_new[s], self.block_size)

    cdef inline int64_t queued_of(self, int32_t s) noexcept nogil:
        """Tokens a waiting request still has to prefill."""
        cdef int64_t q = self.tokens(s) - self.cached[s]
        return q if q > 0 else 0

    cdef inline int check_live(self, int64_t s) except -1:
        """A slot that holds a request (waiting or running)."""
        if s < 0 or s >= <int64_t>self.state.size() or self.state[s] == ST_FREE:
            raise KeyError(f"slot {s} is not a live request")
        return 0

    cdef inline int64_t set_counts(self, int32_t s, int64_t computed, int64_t generated) noexcept nogil:
        """The engine's counts for s: tokens with KV computed, tokens generated.
        Returns the change in s's prefill still to do (waiting) or 0 (running: the
        running context changes)."""
        cdef int64_t before
        if self.state[s] == ST_WAITING:
            before = self.queued_of(s)
            self.computed[s] = computed
            self.generated[s] = generated
            return self.queued_of(s) - before
        self.computed[s] = computed
        self.run_ctx += generated - self.generated[s]
        self.generated[s] = generated
        return 0

    cdef int32_t new_slot(self)
    cdef void release(self, int32_t s) noexcept nogil
    cdef void run_add(self, int32_t s) noexcept nogil
    cdef void run_remove(self, int32_t s) noexcept nogil
    cdef int check_state(self, int64_t s, int want) except -1
