# A workload's requests in columns, checked once (see _requests.pyx): what the
# native engine model (and a fleet of them) takes in `add_requests`.
from libc.stdint cimport int64_t
from libcpp.vector cimport vector

from kvadmit._arrival cimport ArrivalRecord


cdef class Requests:
    cdef vector[ArrivalRecord] records   # what the core gets at each arrival
    cdef vector[double] arrival_s        # fixed arrival time (-1: a session turn, see parent)
    cdef vector[int64_t] output_tokens   # its real output length, in [1, max_new_tokens]
    cdef vector[int64_t] parent          # the earlier request it is the next turn of (-1: none)
    cdef vector[double] delay_s          # a turn's wait after its parent ended
    cdef vector[int64_t] hashed_tokens   # leading tokens its prefix-block ids describe
    cdef vector[int64_t] hash_offsets    # CSR (n + 1, from 0): row i's ids are
    cdef vector[int64_t] hash_ids        #   hash_ids[hash_offsets[i]:hash_offsets[i + 1]]
    cdef readonly bint has_hash_ids
