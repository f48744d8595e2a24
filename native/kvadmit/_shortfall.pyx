# The shortfall (pause) planner: under shortfall "pause", which running requests
# an engine skips this step, keeping their KV, because the free blocks cannot cover
# the tokens they would compute (see AdmissionCore.plan_shortfall). While any is
# paused the core admits nothing (the queue's scan holds as "hold_paused").
#
# With costs (shortfall "cost"), a short request is paused only where that loses
# more than recomputing the victims the engine would preempt for it (from the end of
# its serving order: vLLM preempts running[-1]), in the engine's own step time
# (T = a + b * tokens + c * context), counted in slots (a request for a step):
#   pause      it sits out until a running request finishes, and with no block
#              free the others stall one by one as each needs its next block;
#   recompute  each victim's tokens once more ((b + c) each, a per extra chunk) and
#              its slots until then; the blocks freed past the short one's need feed
#              the others' growth for a while before the same stalls begin.
# A request already recomputed in this shortfall (since a running request last
# finished) is not priced again: the short one pauses.

from libc.stdint cimport int32_t, int64_t
from libcpp.algorithm cimport sort
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from kvadmit._curves cimport cdiv
from kvadmit._ledger cimport less_important
from kvadmit._step_time cimport StepTimeFit


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
                 int64_t priority_margin=0, bint costed=False):
        self.enabled = enabled
        self.costed = enabled and costed
        self.block_size = block_size
        self.by_priority = by_priority
        self.priority_margin = priority_margin
        self.paused_now = self.paused_total = 0
        self.recompute_now = self.recompute_total = 0
        self._episode = 0

    cdef void c_note_recompute(self, int32_t s, int64_t arrival) noexcept nogil:
        """Slot s (the request that arrived `arrival`-th) was preempted for a shortfall."""
        if <size_t>s >= self._recomputed_episode.size():
            self._recomputed_episode.resize(s + 1, -1)
            self._recomputed_arrival.resize(s + 1, -1)
        self._recomputed_episode[s] = self._episode
        self._recomputed_arrival[s] = arrival

    cdef bint c_recomputed(self, int32_t s, int64_t arrival) noexcept nogil:
        """Whether that request was recomputed in this shortfall already."""
        return <size_t>s < self._recomputed_episode.size() \
            and self._recomputed_episode[s] == self._episode \
            and self._recomputed_arrival[s] == arrival

    def plan(self, want_tokens, computed_tokens, held_blocks, int64_t free_blocks,
             int64_t token_budget, int64_t lookahead_tokens=0, priorities=None, costs=None,
             again=None, freed_blocks=None):
        """`c_plan` over Python sequences, checked: the positions paused. ``costs``:
        a dict of ShortfallCosts' fields (a, b, c, wait_steps) to price a pause against
        a recompute (with ``again``: per row, recomputed in this shortfall already;
        ``freed_blocks``: per row, the blocks its preemption frees, at most its held
        ones; None: all it holds)."""
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
        cdef ShortfallCosts c
        cdef vector[char] rep
        if costs is not None:
            c.a, c.b, c.c = costs["a"], costs["b"], costs["c"]
            c.wait_steps = costs["wait_steps"]
            if not (c.a >= 0 and c.b >= 0 and c.c >= 0 and c.wait_steps >= 0):
                raise ValueError(f"costs={costs}: a, b, c and wait_steps must be >= 0")
        rep.assign(n, 0)
        if again is not None:
            if len(again) != n:
                raise ValueError(f"again: {len(again)} entries, expected one per running request ({n})")
            for i in range(n):
                if again[i]:
                    rep[i] = 1
        cdef vector[int64_t] freed
        if freed_blocks is not None:
            freed = _counts("freed_blocks", freed_blocks)
            if <Py_ssize_t>freed.size() != n:
                raise ValueError(f"freed_blocks: {freed.size()} entries, expected one per "
                                 f"running request ({n})")
            for i in range(n):
                if freed[i] > held[i]:
                    raise ValueError(f"freed_blocks[{i}]={freed[i]}: more than its held "
                                     f"blocks ({held[i]})")
        cdef vector[char] paused
        paused.assign(n, 0)
        self.c_plan(want.data(), computed.data(), held.data(), n, free_blocks,
                    token_budget, lookahead_tokens, paused.data(),
                    prio.data() if priorities is not None else NULL,
                    &c if costs is not None else NULL, rep.data(),
                    freed.data() if freed_blocks is not None else NULL)
        return [i for i in range(n) if paused[i]]

    cdef int64_t c_plan(self, const int64_t* want, const int64_t* computed, const int64_t* held,
                        int64_t n, int64_t free_blocks, int64_t budget, int64_t lookahead,
                        char* paused, const int64_t* priority=NULL,
                        const ShortfallCosts* costs=NULL, const char* again=NULL,
                        const int64_t* freed=NULL) noexcept nogil:
        """`c_walk`, counted (paused_now and _total, recompute_now and _total). Returns
        how many are paused. `freed` (NULL: `held`): per entry, the blocks its
        preemption frees (not those another request shares: prefix caching)."""
        self.paused_now = self.recompute_now = 0
        if not self.enabled:
            return 0
        cdef int64_t count = self.c_walk(want, computed, held, n, free_blocks, budget, lookahead,
                                         paused, priority, costs if self.costed else NULL, again,
                                         freed if freed != NULL else held)
        self.paused_now = count
        self.paused_total += count
        self.recompute_total += self.recompute_now
        return count

    cdef int64_t c_walk(self, const int64_t* want, const int64_t* computed, const int64_t* held,
                        int64_t n, int64_t free_blocks, int64_t budget, int64_t lookahead,
                        char* paused, const int64_t* priority, const ShortfallCosts* costs,
                        const char* again, const int64_t* freed) noexcept nogil:
        """In the engine's serving order each running request takes min(want, budget
        left) tokens and the blocks they need (plus `lookahead`) while blocks last;
        one that finds too few is paused (paused[i] = 1). Returns how many.
        With `priority` (one per entry) under queue_order "priority": entries in
        (priority, position) order, the most important first, and one short of blocks
        takes them from those entries of strictly lower priority (by more than
        priority_preemption_threshold) hold (not yet taken)
        if they suffice (the engine preempts those, lowest first).
        With `costs` (and no priority order): one short of blocks is not paused where
        recomputing the entries the engine would preempt for it, from the end, costs
        less (`_recompute_wins`); those are then gone from this step (recompute_now
        counts such requests), and their `freed` blocks with them (read only with
        `costs`; c_plan passes `held` for NULL)."""
        cdef int64_t i, j, k, w, need, lower, taken = 0, count = 0, served = 0, first = -1
        cdef int64_t tail = n        # entries [tail, n) go to the engine's preemption
        cdef int64_t step_budget = budget
        cdef bint ranked = priority != NULL and self.by_priority
        cdef double step_s = 0.0
        cdef vector[pair[int64_t, int64_t]] order
        for i in range(n):
            paused[i] = 0
            if ranked:
                order.push_back(pair[int64_t, int64_t](priority[i], i))
        if ranked:
            sort(order.begin(), order.end())
        if costs != NULL and not ranked:
            step_s = _step_seconds(want, computed, n, budget, costs)
            self._n_live = 0
            for i in range(n):
                if want[i] > 0:
                    self._n_live += 1
        for k in range(n):
            i = order[k].second if ranked else k
            if i >= tail:
                break               # preempted for an earlier one
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
            elif costs != NULL:
                j = self._recompute_wins(i, tail, need, free_blocks, computed, freed, again,
                                         costs, step_s, step_budget)
                if j >= 0:
                    self.recompute_now += 1
                    while tail > j:
                        tail -= 1
                        free_blocks += freed[tail]
                    if j > i:
                        free_blocks -= need
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
        return count

    cdef int64_t _recompute_wins(self, int64_t i, int64_t tail, int64_t need, int64_t free_blocks,
                                 const int64_t* computed, const int64_t* freed, const char* again,
                                 const ShortfallCosts* costs, double step_s,
                                 int64_t budget) noexcept nogil:
        """Entry i is short by `need` blocks. The engine would preempt entries from the
        end ([j, tail)) until their `freed` blocks make i fit, i itself last (j = i: all
        of [i, tail) go). Returns
        j where recomputing them loses less than pausing i, else -1 (also where one
        of them was recomputed in this shortfall already)."""
        cdef int64_t j = tail, gain = 0
        cdef double redo = 0.0
        while free_blocks + gain < need:
            j -= 1
            if again != NULL and again[j]:
                return -1
            gain += freed[j]
            redo += _recompute_seconds(computed[j], costs, budget)
            if j == i:
                break               # i itself goes: it needs no block then
        # A slot is one request running for one step: step_s / live rows. Pausing
        # i: it sits out the wait, and with no block free the rest stall one by one
        # as each needs its next block (live / block_size blocks a step). Recomputing:
        # the victims sit out the wait instead, and the blocks they free past i's
        # need feed that growth for `fed` steps before the same stalls begin.
        cdef double wt = costs.wait_steps, live = self._n_live if self._n_live > 0 else 1
        cdef double slot = step_s / live, rate = live / self.block_size
        cdef double hold = slot * (wt + _stalls(wt - free_blocks / rate, rate, live))
        cdef double fed = (free_blocks + gain - (need if j > i else 0)) / rate
        redo += slot * ((tail - j) * wt + _stalls(wt - fed, rate, live))
        return j if redo < hold else -1


cdef ShortfallCosts shortfall_costs(StepTimeFit fit, int64_t wait_steps) noexcept nogil:
    """The prices from a step-time fit (a, b and c, each at least 0) and the steps until
    a running request is expected to finish (at least 1)."""
    cdef ShortfallCosts c
    c.a = fit.c_predict(0.0, 0.0)
    c.b = (fit.c_predict(1024.0, 0.0) - c.a) / 1024.0
    c.c = (fit.c_predict(0.0, 65536.0) - c.a) / 65536.0
    c.b = c.b if c.b > 0.0 else 0.0
    c.c = c.c if c.c > 0.0 else 0.0
    c.wait_steps = wait_steps if wait_steps > 1 else 1
    return c


cdef inline double _stalls(double steps, double rate, double live) noexcept nogil:
    """Request-steps stalled over `steps` steps with no block free: one more request
    each 1 / rate steps, at most every live one."""
    if steps <= 0.0:
        return 0.0
    cdef double full = live / rate
    if steps <= full:
        return rate * steps * steps / 2.0
    return live * full / 2.0 + live * (steps - full)


cdef inline double _recompute_seconds(int64_t tokens, const ShortfallCosts* c,
                                      int64_t budget) noexcept nogil:
    """Computing `tokens` once more: per token (b + c: each token is in the chunk's
    context once), and a step's fixed cost for each chunk past the first."""
    cdef int64_t chunks = cdiv(tokens, budget) if budget > 0 else 1
    return (c.b + c.c) * tokens + c.a * (chunks - 1 if chunks > 1 else 0)


cdef inline double _step_seconds(const int64_t* want, const int64_t* computed, int64_t n,
                                 int64_t budget, const ShortfallCosts* c) noexcept nogil:
    """This step's time if every entry ran: its tokens (at most the budget) and context."""
    cdef int64_t i, tokens = 0, context = 0
    for i in range(n):
        tokens += want[i]
        context += computed[i]
    if tokens > budget:
        tokens = budget
    return c.a + c.b * tokens + c.c * (context + tokens)
