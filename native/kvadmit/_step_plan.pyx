# The step planner: kvadmit's side of one engine step, written once for every engine
# (kvadmit's vLLM scheduler and the simulator's native engine fill the same view; the
# engine's own step arithmetic, what each running request would compute, stays the
# engine's: compat.running_step_tokens for vLLM).
#
# Before the step the engine asks the core for the victim order (the port's step)
# and puts its running list in it; then, here, in two halves, because the second
# reads the running list the first leaves:
#   1. displacement. c_candidate: the waiting request the core lets start on running
#      requests' KV (priority retraction, flow displacement: Decision.c_mark_takeable
#      says whose) and its displaceable ones, first victim first. The engine fills in
#      the candidate's need (prompt_need) and, per victim, the blocks its preemption
#      frees. c_displace: the fewest victims, first first, that make the need and the
#      watermark beside it free, or none. The engine preempts `displaced`; the
#      candidate starts first in this step.
#   2. pauses (shortfall "pause" or "cost"). The engine fills one row per running request, in
#      serving order: the tokens it would compute, its computed tokens, held blocks,
#      priority, slot and the blocks its preemption frees (under "cost": those no other
#      request shares). c_pause: the ShortfallPlanner's plan; the engine skips the
#      `paused` rows this step, their KV kept. (Under "cost" a short row the plan
#      does not pause preempts the engine's victims as usual: it priced that cheaper.)

from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._core cimport AdmissionCore
from kvadmit._shortfall cimport ShortfallCosts, shortfall_costs
from kvadmit._ledger cimport ST_RUNNING


def prompt_blocks(int64_t tokens, int64_t computed, int64_t hit_blocks, int64_t fresh_hits,
                  int64_t chunk_cap, int64_t lookahead, int64_t block_size):
    """`prompt_need`, for Python adapters."""
    for name, v in (("tokens", tokens), ("computed", computed), ("hit_blocks", hit_blocks),
                    ("fresh_hits", fresh_hits), ("chunk_cap", chunk_cap), ("lookahead", lookahead)):
        if v < 0:
            raise ValueError(f"{name}={v}: must be >= 0")
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    return prompt_need(tokens, computed, hit_blocks, fresh_hits, chunk_cap, lookahead, block_size)


cdef class StepPlanner:
    """Plans displacement and pauses for an engine around one AdmissionCore."""

    def __init__(self, AdmissionCore core not None, int64_t watermark_blocks=0,
                 int64_t lookahead_tokens=0):
        for name, v in (("watermark_blocks", watermark_blocks), ("lookahead_tokens", lookahead_tokens)):
            if v < 0:
                raise ValueError(f"{name}={v}: must be >= 0")
        self.core = core
        self.watermark, self.lookahead = watermark_blocks, lookahead_tokens
        self.candidate = -1

    # -- 1. displacement --------------------------------------------------------------
    cdef int32_t c_candidate(self, int64_t free_blocks, bint with_victims) noexcept nogil:
        """The waiting request the core lets start now, if running requests' KV may be
        taken for it; -1: none. `with_victims`: its displaceable ones too (`c_victims`),
        and -1 where it has none; else the engine asks `c_victims` once it is short."""
        self.candidate, self.need = -1, 0
        self.victims.clear()
        self.displaced.clear()
        if not self.core.decision.c_may_take_kv():
            return -1
        cdef int32_t s = self.core.c_next_admissible(free_blocks, False)
        if s < 0:
            return -1
        self.candidate = s
        if with_victims and self.c_victims() == 0:
            self.candidate = -1
        return self.candidate

    cdef size_t c_victims(self) noexcept nogil:
        """The candidate's displaceable ones, first victim first, into `victims`, their
        `freed` at -1 until the engine fills them in; how many."""
        self.core.c_displaceable(self.candidate, self.victims)
        self.freed.assign(self.victims.size(), -1)
        self.kept.assign(self.victims.size(), 0)
        return self.victims.size()

    cdef bint c_short(self, int64_t free_blocks, int64_t running) noexcept nogil:
        """Whether the candidate's need, with the watermark beside it while `running`
        requests run, is more than is free (else nothing is displaced)."""
        return self.candidate >= 0 and \
            self.need + watermark_beside(self.watermark, running) > free_blocks

    cdef size_t c_displace(self, int64_t free_blocks, int64_t running) noexcept nogil:
        """`displaced`: the fewest victims, first victim first, whose blocks (less the
        candidate's hits on them: it takes those straight back) make its need free, and
        --watermark's blocks while another request still runs; none if even all of them
        would not. Victims the engine cannot free (freed < 0) are passed over."""
        cdef int64_t gain = 0, chosen = 0
        cdef size_t k
        self.displaced.clear()
        if not self.c_short(free_blocks, running):
            return 0
        for k in range(self.victims.size()):
            if self.freed[k] < 0:
                continue
            self.displaced.push_back(self.victims[k])
            chosen += 1
            gain += self.freed[k] - self.kept[k]
            if free_blocks + gain >= self.need + watermark_beside(self.watermark, running - chosen):
                return self.displaced.size()
        self.displaced.clear()
        return 0

    # -- 2. pauses ------------------------------------------------------------------------
    cdef int64_t* c_rows(self, int64_t n) noexcept nogil:
        """Room for n running rows: columns want, computed, held, priority, slot, freed
        at k * n."""
        self.n_rows = n
        self.rows.resize(6 * n)
        self.paused.assign(n, 0)
        return self.rows.data()

    cdef bint c_priced(self, int64_t free_blocks, int64_t budget) noexcept nogil:
        """Whether this step's plan prices its shortfalls: under "cost", only in a step
        where a row would pause (the prices read every running request's forecast, and
        an engine fills the freed column only then: it walks every held block). Reads
        the first three columns."""
        cdef int64_t n = self.n_rows
        cdef int64_t* cols = self.rows.data()
        return self.core.shortfall.costed and not self.core.shortfall.by_priority and \
            self.core.shortfall.c_walk(cols, cols + n, cols + 2 * n, n, free_blocks, budget,
                                       self.lookahead, self.paused.data(), NULL, NULL,
                                       NULL, NULL) > 0

    cdef int64_t c_pause(self, int64_t free_blocks, int64_t budget) noexcept nogil:
        """`paused`: the rows that sit this step out (the ShortfallPlanner's plan; it
        reads the priorities under queue_order "priority", the slots and freed blocks
        in a step `c_priced`). Returns how many."""
        cdef int64_t n = self.n_rows, i, s
        cdef int64_t* cols = self.rows.data()
        cdef ShortfallCosts costs
        if self.c_priced(free_blocks, budget):
            costs = shortfall_costs(self.core.slo_guard.step_time, self.core.policy.c_soonest_finish())
            self.again.assign(n, 0)
            for i in range(n):
                s = cols[4 * n + i]
                self.again[i] = s >= 0 and self.core.shortfall.c_recomputed(
                    <int32_t>s, self.core.ledger.arrival(<int32_t>s))
            return self.core.shortfall.c_plan(cols, cols + n, cols + 2 * n, n, free_blocks, budget,
                                              self.lookahead, self.paused.data(), cols + 3 * n,
                                              &costs, self.again.data(), cols + 5 * n)
        return self.core.c_plan_shortfall(cols, cols + n, cols + 2 * n, n, free_blocks, budget,
                                          self.lookahead, self.paused.data(), cols + 3 * n)

    # -- Python adapters' entry points ---------------------------------------------------
    def find_candidate(self, int64_t free_blocks):
        """`c_candidate`: (slot, its displaceable slots, first victim first), or (-1, [])."""
        _check_counts(free_blocks=free_blocks)
        cdef int32_t s = self.c_candidate(free_blocks, True)
        return s, [v for v in self.victims]

    def is_short(self, int64_t need, int64_t free_blocks, int64_t running):
        """Sets the candidate's need (blocks); whether it is short of free blocks (only
        then do the victims' blocks matter)."""
        _check_counts(need=need, free_blocks=free_blocks, running=running)
        if self.candidate < 0:
            raise ValueError("is_short: no candidate (find_candidate found none)")
        self.need = need
        return self.c_short(free_blocks, running)

    def displace(self, int64_t free_blocks, int64_t running, freed, kept):
        """`c_displace`, given per victim (find_candidate's order) the blocks its
        preemption frees (-1: it cannot be preempted now) and how many of those the
        candidate hits: the slots to preempt."""
        _check_counts(free_blocks=free_blocks, running=running)
        if len(freed) != <Py_ssize_t>self.victims.size() or len(kept) != len(freed):
            raise ValueError(f"freed, kept: one entry per victim ({self.victims.size()}), got "
                             f"{len(freed)}, {len(kept)}")
        for k in range(len(freed)):
            self.freed[k], self.kept[k] = freed[k], kept[k]
        self.c_displace(free_blocks, running)
        return [v for v in self.displaced]

    def pause(self, want, computed, held, priority, int64_t free_blocks, int64_t budget,
              slots=None, freed=None):
        """`c_pause` over the running requests in serving order (the tokens each would
        compute this step, its computed tokens, held blocks; priority: None unless
        queue_order is "priority"; slots: each one's slot in the core, and freed: the
        blocks its preemption frees (held less those other requests share), or a
        callable returning them, called only in a step `c_priced`; both read under
        shortfall "cost" only, None: not known, all held): the positions paused."""
        _check_counts(free_blocks=free_blocks, budget=budget)
        cdef Py_ssize_t n = len(want), i
        for name, col in (("computed", computed), ("held", held),
                          ("priority", want if priority is None else priority),
                          ("slots", want if slots is None else slots)):
            if len(col) != n:
                raise ValueError(f"{name}: {len(col)} entries, expected one per row ({n})")
        cdef int64_t* rows = self.c_rows(n)
        for i in range(n):
            if want[i] < 0 or computed[i] < 0 or held[i] < 0:
                raise ValueError(f"row {i}: want={want[i]}, computed={computed[i]}, "
                                 f"held={held[i]}: must be >= 0")
            rows[i], rows[n + i], rows[2 * n + i] = want[i], computed[i], held[i]
            rows[3 * n + i] = 0 if priority is None else priority[i]
            rows[4 * n + i] = -1 if slots is None else slots[i]
            rows[5 * n + i] = held[i]
            if rows[4 * n + i] != -1 and self.core.shortfall.costed:   # read only under "cost"
                self.core.ledger.check_state(rows[4 * n + i], ST_RUNNING)
        if freed is not None and (not callable(freed) or self.c_priced(free_blocks, budget)):
            self._fill_freed(freed() if callable(freed) else freed, held)
        self.c_pause(free_blocks, budget)
        return [i for i in range(n) if self.paused[i]]

    def _fill_freed(self, freed, held):
        cdef Py_ssize_t n = self.n_rows, i
        if len(freed) != n:
            raise ValueError(f"freed: {len(freed)} entries, expected one per row ({n})")
        for i in range(n):
            if not 0 <= freed[i] <= held[i]:
                raise ValueError(f"row {i}: freed={freed[i]}: must be in [0, held={held[i]}]")
            self.rows[5 * n + i] = freed[i]


def _check_counts(**counts):
    for name, v in counts.items():
        if v < 0:
            raise ValueError(f"{name}={v}: must be >= 0")

