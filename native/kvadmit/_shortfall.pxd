# The shortfall planner's C-level API (see _shortfall.pyx): under shortfall "pause",
# which running requests sit out this step; under "cost", which short ones instead
# let the engine recompute its victims.
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._step_time cimport StepTimeFit


cdef struct ShortfallCosts:
    double a, b, c           # the engine's step time: T = a + b * tokens + c * context
    double wait_steps        # steps until a running request is expected to finish


cdef ShortfallCosts shortfall_costs(StepTimeFit fit, int64_t wait_steps) noexcept nogil


cdef class ShortfallPlanner:
    cdef readonly bint enabled            # shortfall: "pause"
    cdef readonly bint costed             # shortfall "cost": pause or recompute, whichever loses less
    cdef int64_t block_size
    cdef bint by_priority                 # queue_order "priority": the plan reads priorities
    cdef int64_t priority_margin          # priority_preemption_threshold
    cdef readonly int64_t paused_now      # running requests paused this step
    cdef readonly int64_t paused_total    # request-steps paused in all
    cdef readonly int64_t recompute_now   # short requests this step left to recompute victims
    cdef readonly int64_t recompute_total # in all
    # The no-thrash rule: the requests recomputed since a running request last finished
    # (a shortfall lasts until one does), as (slot, arrival) pairs of this episode.
    cdef int64_t _episode
    cdef int64_t _n_live                  # rows that want tokens this step (the priced walk)
    cdef vector[int64_t] _recomputed_episode, _recomputed_arrival   # per slot

    cdef inline void c_new_step(self) noexcept nogil:
        self.paused_now = 0
        self.recompute_now = 0

    cdef inline void c_note_finish(self) noexcept nogil:
        self._episode += 1

    cdef void c_note_recompute(self, int32_t s, int64_t arrival) noexcept nogil
    cdef bint c_recomputed(self, int32_t s, int64_t arrival) noexcept nogil
    cdef int64_t c_plan(self, const int64_t* want, const int64_t* computed, const int64_t* held,
                        int64_t n, int64_t free_blocks, int64_t budget, int64_t lookahead,
                        char* paused, const int64_t* priority=*,
                        const ShortfallCosts* costs=*, const char* again=*,
                        const int64_t* freed=*) noexcept nogil
    cdef int64_t c_walk(self, const int64_t* want, const int64_t* computed, const int64_t* held,
                        int64_t n, int64_t free_blocks, int64_t budget, int64_t lookahead,
                        char* paused, const int64_t* priority, const ShortfallCosts* costs,
                        const char* again, const int64_t* freed) noexcept nogil
    cdef int64_t _recompute_wins(self, int64_t i, int64_t tail, int64_t need, int64_t free_blocks,
                                 const int64_t* computed, const int64_t* freed, const char* again,
                                 const ShortfallCosts* costs, double step_s,
                                 int64_t budget) noexcept nogil
