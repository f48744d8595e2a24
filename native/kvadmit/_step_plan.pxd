# The step planner's C-level API (see _step_plan.pyx): kvadmit's side of one engine
# step, once for every engine. An engine fills the view, calls c_plan, applies the plan.
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._core cimport AdmissionCore
from kvadmit._curves cimport cdiv


cdef inline int64_t prompt_need(int64_t tokens, int64_t computed, int64_t hit_blocks,
                                int64_t fresh_hits, int64_t chunk_cap, int64_t lookahead,
                                int64_t block_size) noexcept nogil:
    """The free blocks a waiting request takes when it starts: those of its uncached
    tokens (`tokens` of input, `computed` or `hit_blocks` full blocks of it already
    there, at most `chunk_cap` of them allocated now) and the engine's `lookahead`
    slots, plus each prefix hit on a cached-free block (`fresh_hits`: touching one
    takes it out of the free pool)."""
    cdef int64_t have = hit_blocks * block_size
    if computed > have:
        have = computed
    cdef int64_t uncached = tokens - have
    if uncached > chunk_cap:
        uncached = chunk_cap
    return cdiv(uncached + lookahead, block_size) + fresh_hits


cdef inline int64_t watermark_beside(int64_t watermark, int64_t others_running) noexcept nogil:
    """The blocks the engine keeps free beside a starting request's (vLLM's
    --watermark, KVCacheManager.allocate_slots): only while another request runs."""
    return watermark if others_running > 0 else 0


cdef class StepPlanner:
    cdef readonly AdmissionCore core
    cdef readonly int64_t watermark        # blocks kept free beside a starting request
    cdef readonly int64_t lookahead        # slots the engine allocates past each request's tokens
    # 1. displacement: the candidate (the waiting request the core lets start on
    # running requests' KV), its need and its displaceable ones; the plan
    cdef readonly int32_t candidate        # its slot, or -1
    cdef public int64_t need               # the free blocks it takes when it starts
    cdef vector[int32_t] victims           # its displaceable ones, first victim first
    cdef vector[int64_t] freed             # per victim: blocks that come free if preempted (-1: it cannot be)
    cdef vector[int64_t] kept              # per victim: of those, the candidate's prefix hits
    cdef vector[int32_t] displaced         # the plan: the victims to preempt (slots)
    # 2. pauses: the running requests in serving order; the plan
    cdef vector[int64_t] rows              # want, computed, held, priority, slot, freed: 6 columns of n_rows
    cdef vector[char] again                # scratch: per row, recomputed in this shortfall ("cost")
    cdef int64_t n_rows
    cdef vector[char] paused               # per row: sits this step out

    cdef int32_t c_candidate(self, int64_t free_blocks, bint with_victims) noexcept nogil
    cdef size_t c_victims(self) noexcept nogil
    cdef bint c_short(self, int64_t free_blocks, int64_t running) noexcept nogil
    cdef size_t c_displace(self, int64_t free_blocks, int64_t running) noexcept nogil
    cdef int64_t* c_rows(self, int64_t n) noexcept nogil
    cdef bint c_priced(self, int64_t free_blocks, int64_t budget) noexcept nogil
    cdef int64_t c_pause(self, int64_t free_blocks, int64_t budget) noexcept nogil
