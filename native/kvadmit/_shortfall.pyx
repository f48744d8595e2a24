# The shortfall (pause) planner: under shortfall "pause", which running requests
# an engine skips this step, keeping their KV, because the free blocks cannot cover
# the tokens they would compute (see AdmissionCore.plan_shortfall). While any is
# paused the core admits nothing (the queue's scan holds as "hold_paused").

from libc.stdint cimport int64_t
from libcpp.algorithm cimport sort
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from kvadmit._curves cimport cdiv
from kvadmit._ledger cimport less_important


cdef vector[int64_t] _counts(str name, values) except *:
    """A sequence of counts (>= 0) as a native vector; a negative one names its index."""
    cdef vector[int64_t] v
    for i, x in enumerate(values):
        if x < 0:
            raise ValueError(f"{name}[{i}]={x}: must be >= 0")
        v.push_back(x)
    return v


cdef class ShortfallPlanner:
    """Plans each step's pauses over a pool of `block_size`-token blocks."""

    def __init__(self, bint enabled, int64_t block_size, bint by_priority=False,
                 int64_t priority_margin=0):
        self.enabled = enabled
        self.block_size = block_size
        self.by_priority = by_priority
        self.priority_margin = priority_margin
        self.paused_now = self.paused_total = 0

    def plan(self, want_tokens, computed_tokens, held_blocks, int64_t free_blocks,
             int64_t token_budget, int64_t lookahead_tokens=0, priorities=None):
        """`c_plan` over Python sequences, checked: the positions paused."""
        cdef Py_ssize_t n = len(want_tokens)
        if len(computed_tokens) != n or len(held_blocks) != n:
            raise ValueError(f"want_tokens, computed_tokens and held_blocks must have one entry "
                             f"per running request: got {n}, {len(computed_tokens)}, {len(held_blocks)}")
        for name, v in (("free_blocks", free_blocks), ("token_budget", token_budget),
                        ("lookahead_tokens", lookahead_tokens)):
            if v < 0:
                raise ValueError(f"{name}={v}: must be >= 0")
        cdef vector[int64_t] want = _counts("want_tokens", want_tokens)
        cdef vector[int64_t] computed = _counts("computed_tokens", computed_tokens)
        cdef vector[int64_t] held = _counts("held_blocks", held_blocks)
        cdef vector[int64_t] prio
        if priorities is not None:
            if len(priorities) != n:
                raise ValueError(f"priorities: {len(priorities)} entries, expected one per running "
                                 f"request ({n})")
            for x in priorities:
                prio.push_back(x)
        cdef vector[char] paused
        paused.assign(n, 0)
        self.c_plan(want.data(), computed.data(), held.data(), n, free_blocks,
                    token_budget, lookahead_tokens, paused.data(),
                    prio.data() if priorities is not None else NULL)
        return [i for i in range(n) if paused[i]]

    cdef int64_t c_plan(self, const int64_t* want, const int64_t* computed, const int64_t* held,
                        int64_t n, int64_t free_blocks, int64_t budget, int64_t lookahead,
                        char* paused, const int64_t* priority=NULL) noexcept nogil:
        """In the engine's serving order each running request takes min(want, budget
        left) tokens and the blocks they need (plus `lookahead`) while blocks last;
        one that finds too few is paused (paused[i] = 1). Returns how many.
        With `priority` (one per entry) under queue_order "priority": entries in
        (priority, position) order, the most important first, and one short of blocks
        takes them from those entries of strictly lower priority (by more than
        priority_preemption_threshold) hold (not yet taken)
        if they suffice (the engine preempts those, lowest first)."""
        cdef int64_t i, j, k, w, need, lower, taken = 0, count = 0, served = 0, first = -1
        self.paused_now = 0
        if not self.enabled:
            return 0
        cdef bint ranked = priority != NULL and self.by_priority
        cdef vector[pair[int64_t, int64_t]] order
        for i in range(n):
            paused[i] = 0
            if ranked:
                order.push_back(pair[int64_t, int64_t](priority[i], i))
        if ranked:
            sort(order.begin(), order.end())
        for k in range(n):
            i = order[k].second if ranked else k
            w = want[i] if want[i] < budget else budget
            if w <= 0:
                continue            # the engine does not reach it this step anyway
            need = cdiv(computed[i] + w + lookahead, self.block_size) - held[i]
            if need <= free_blocks:
                free_blocks -= need if need > 0 else 0
                budget -= w
                served += 1
                continue
            if ranked:
                lower = 0
                for j in range(n):
                    if less_important(priority[j], priority[i], self.priority_margin):
                        lower += held[j]
                if need <= free_blocks + lower - taken:
                    taken += need - free_blocks     # the engine preempts lower ones for it
                    free_blocks = 0
                    budget -= w
                    served += 1
                    continue
            paused[i] = 1
            count += 1
            if first < 0:
                first = i
        if served == 0 and count > 0:
            # Nothing could run: the first (the most important) runs, taking what the
            # engine's victims give back; the rest stay paused rather than each
            # preempting in turn.
            paused[first] = 0
            count -= 1
        self.paused_now = count
        self.paused_total += count
        return count
