# The request ledger: every request's numbers, in native arrays indexed by a
# slot, and the running set with its sums. Slots are reused after release.

from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

STATES = ("free", "waiting", "running")


cdef class Ledger:
    """Requests by slot (see the .pxd for the arrays)."""

    def __init__(self, int64_t block_size, int64_t prefill_chunk):
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.step = 0
        self.reserve_sum = self.run_ctx = 0

    cdef int32_t new_slot(self):
        """A free slot (its arrays hold the last occupant's numbers: set them)."""
        cdef int32_t s
        if not self._free_slots.empty():
            s = self._free_slots.back()
            self._free_slots.pop_back()
            return s
        s = <int32_t>self.prompt.size()
        self.prompt.push_back(0); self.cached.push_back(0); self.computed.push_back(0)
        self.generated.push_back(0); self.max_new.push_back(0); self.priority.push_back(0)
        self.arrival.push_back(0); self.admit_seq.push_back(-1); self.admit_step.push_back(-1)
        self.held_step.push_back(-1)
        self.blocks.push_back(0); self.pred_total.push_back(0); self.shared.push_back(0)
        self.bypassed.push_back(0); self.preempts.push_back(0); self._run_pos.push_back(-1)
        self.state.push_back(ST_FREE); self.sheddable.push_back(0)
        self.ttft.push_back(0.0); self.tpot.push_back(0.0); self.arrive_t.push_back(0.0)
        self.engine_t.push_back(0.0); self.engine_tie.push_back(0.0)
        self.session.push_back(-1); self.activated_by.push_back(0)
        return s

    cdef void release(self, int32_t s) noexcept nogil:
        self.state[s] = ST_FREE
        self._free_slots.push_back(s)

    cdef void run_add(self, int32_t s) noexcept nogil:
        self.state[s] = ST_RUNNING
        self._run_pos[s] = <int32_t>self.running.size()
        self.running.push_back(s)
        self.reserve_sum += self.reserve_blocks(s)
        self.run_ctx += self.tokens(s)

    cdef void run_remove(self, int32_t s) noexcept nogil:
        """Takes s out of the running set (its state is the caller's to set)."""
        cdef int32_t pos = self._run_pos[s]
        cdef int32_t last = self.running.back()
        self.running[pos] = last
        self._run_pos[last] = pos
        self.running.pop_back()
        self._run_pos[s] = -1
        self.reserve_sum -= self.reserve_blocks(s)
        self.run_ctx -= self.tokens(s)

    cdef int check_state(self, int64_t s, int want) except -1:
        """A live slot in state `want` (ST_WAITING or ST_RUNNING)."""
        self.check_live(s)
        if self.state[s] != want:
            raise ValueError(
                f"slot {s} is {STATES[<int>self.state[s]]}, "
                f"expected {STATES[want]}")
        return 0
