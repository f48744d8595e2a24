# Victim order: which running request gives its KV back first when the pool runs
# out. Each order is a key per running request, from most protected to first
# victim; ties fall to arrival order, so every tensor-parallel rank agrees.
#   lifo      the latest admitted goes first (vLLM's default);
#   priority  the least important (largest priority value) first, then the one
#             with the least computed;
#   lcf       least computed first (the cheapest to recompute);
#   length    fewest generated tokens first, then the longest prompt.
# Under queue_order "priority" every order is taken within priority classes: the
# least important class (largest priority value) gives its KV back first, so a
# request is never preempted while one of strictly lower priority runs. Under every
# queue order sheddable requests give theirs back before any other. Under flows
# (`over_share`: per flow index, whether the flow is over its weighted share of the
# pool, FlowTable.c_over_share), within a priority class the requests of flows over
# their share give theirs back first.

from libc.stdint cimport int32_t, int64_t
from libcpp.algorithm cimport sort
from libcpp.vector cimport vector

from kvadmit._ledger cimport Ledger

VICTIMS = ("lifo", "priority", "lcf", "length")


cdef struct VictimKey:
    int64_t kc      # sheddable (1) after every other (0)
    int64_t k0      # the priority class first (queue_order "priority"), else 0
    int64_t kf      # a flow over its share (1) after the others (0)
    int64_t k1
    int64_t k2
    int64_t k3
    int32_t slot


cdef bint victim_key_less(const VictimKey& a, const VictimKey& b) noexcept nogil:
    """Orders running requests from most protected to first victim."""
    if a.kc != b.kc:
        return a.kc < b.kc
    if a.k0 != b.k0:
        return a.k0 < b.k0
    if a.kf != b.kf:
        return a.kf < b.kf
    if a.k1 != b.k1:
        return a.k1 < b.k1
    if a.k2 != b.k2:
        return a.k2 < b.k2
    if a.k3 != b.k3:
        return a.k3 < b.k3
    return a.slot < b.slot


cdef inline VictimKey victim_key(Ledger L, int order, int32_t s, bint by_priority,
                                 const char* over_share) noexcept nogil:
    cdef VictimKey k
    k.kc = L.sheddable(s)
    k.k0 = L.priority(s) if by_priority else 0
    k.kf = over_share[L.flow_ix(s)] if over_share != NULL else 0
    k.slot = s
    if order == V_LIFO:
        k.k1 = L.admit_seq(s); k.k2 = L.arrival(s); k.k3 = 0
    elif order == V_PRIORITY:
        k.k1 = L.priority(s); k.k2 = -L.computed(s); k.k3 = L.arrival(s)
    elif order == V_LCF:
        k.k1 = -L.computed(s); k.k2 = L.arrival(s); k.k3 = 0
    else:  # length: fewest generated, then longest prompt
        k.k1 = -L.generated(s); k.k2 = L.prompt(s); k.k3 = L.arrival(s)
    return k


cdef int32_t victim_slot(Ledger L, int order, bint by_priority=False,
                         const char* over_share=NULL) noexcept nogil:
    """The running request to preempt first, or -1 (`by_priority`: within the least
    important priority class running; `over_share`: flows over their share first)."""
    if L.n_running() == 0:
        return -1
    cdef VictimKey best = victim_key(L, order, L.running_at(0), by_priority, over_share)
    cdef VictimKey k
    cdef size_t i
    for i in range(1, L.n_running()):
        k = victim_key(L, order, L.running_at(i), by_priority, over_share)
        if victim_key_less(best, k):
            best = k
    return best.slot


cdef void victim_order_into(Ledger L, int order, bint by_priority, const char* over_share,
                            vector[int32_t]& out) noexcept nogil:
    """Running slots from most protected to first victim (the last one goes first),
    into `out`."""
    cdef vector[VictimKey] keys
    cdef size_t i
    for i in range(L.n_running()):
        keys.push_back(victim_key(L, order, L.running_at(i), by_priority, over_share))
    sort(keys.begin(), keys.end(), victim_key_less)
    out.clear()
    for i in range(keys.size()):
        out.push_back(keys[i].slot)


cdef list victim_order(Ledger L, int order, bint by_priority=False, const char* over_share=NULL):
    """`victim_order_into`, as a list."""
    cdef vector[int32_t] out
    victim_order_into(L, order, by_priority, over_share, out)
    return list(out)


cdef void victims_first(Ledger L, int order, bint by_priority, const char* over_share,
                        const vector[char]& among, vector[int32_t]& out) noexcept nogil:
    """The running requests marked in `among` (by position in the running set), first
    victim first, into `out`."""
    cdef vector[VictimKey] keys
    cdef size_t i
    for i in range(L.n_running()):
        if among[i]:
            keys.push_back(victim_key(L, order, L.running_at(i), by_priority, over_share))
    sort(keys.begin(), keys.end(), victim_key_less)
    out.clear()
    i = keys.size()
    while i > 0:
        i -= 1
        out.push_back(keys[i].slot)
