# The shortfall planner's C-level API (see _shortfall.pyx): under shortfall "pause",
# which running requests sit out this step.
from libc.stdint cimport int64_t


cdef class ShortfallPlanner:
    cdef readonly bint enabled            # shortfall: "pause"
    cdef int64_t block_size
    cdef bint by_priority                 # queue_order "priority": the plan reads priorities
    cdef int64_t priority_margin          # priority_preemption_threshold
    cdef readonly int64_t paused_now      # running requests paused this step
    cdef readonly int64_t paused_total    # request-steps paused in all

    cdef inline void c_new_step(self) noexcept nogil:
        self.paused_now = 0

    cdef int64_t c_plan(self, const int64_t* want, const int64_t* computed, const int64_t* held,
                        int64_t n, int64_t free_blocks, int64_t budget, int64_t lookahead,
                        char* paused, const int64_t* priority=*) noexcept nogil
