# Victim order's C-level API (see _victims.pyx).
from libc.stdint cimport int32_t
from libcpp.vector cimport vector

from kvadmit._ledger cimport Ledger

cdef enum:  # indexes into VICTIMS
    V_LIFO = 0
    V_PRIORITY = 1
    V_LCF = 2
    V_LENGTH = 3

cdef int32_t victim_slot(Ledger ledger, int order, bint by_priority=*,
                         const char* over_share=*) noexcept nogil
cdef void victim_order_into(Ledger ledger, int order, bint by_priority, const char* over_share,
                            vector[int32_t]& out) noexcept nogil
cdef list victim_order(Ledger ledger, int order, bint by_priority=*, const char* over_share=*)
cdef void victims_first(Ledger ledger, int order, bint by_priority, const char* over_share,
                        const vector[char]& among, vector[int32_t]& out) noexcept nogil
