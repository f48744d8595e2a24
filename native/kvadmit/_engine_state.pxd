# The native engine's state (see _engine_state.pyx): its requests, their KV blocks
# and prefix hashes, the arrivals' order and the totals. NativeEngine (kvadmit.
# _native_engine) extends it with the step loop.
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.pair cimport pair
from libcpp.queue cimport priority_queue
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._allocator cimport BlockAllocator
from kvadmit._arrival cimport ArrivalRecord
from kvadmit._arrival_gate cimport Rejection
from kvadmit._core cimport AdmissionCore
from kvadmit._session_hold cimport SessionHold


cdef enum:      # a request's state in the engine (_rstate)
    RQ_PENDING = 0
    RQ_WAITING = 1
    RQ_RUNNING = 2
    RQ_DONE = 3
    RQ_REJECTED = 4


cdef class EngineState:
    cdef readonly AdmissionCore core
    cdef readonly BlockAllocator allocator
    cdef readonly SessionHold session_hold   # clients' kv_hold_s: sessions whose cached KV goes first
    cdef int64_t _bs, _nblocks, _max_seqs, _max_active, _budget, _hash_block, _watermark
    cdef bint _chunked, _prefix, _full_input
    # vLLM's --scheduling-policy priority: vLLM keeps its running order and picks its
    # own victim (the largest priority value, then the latest arrival)
    cdef bint _vllm_priority
    cdef double _step_a_s, _step_b_s, _step_c_s, _sample_dt
    # requests, by index in arrival order
    cdef vector[double] _arr
    cdef vector[ArrivalRecord] _rec     # what the core gets at each arrival
    cdef vector[int64_t] _prompt, _out, _hoff, _hids, _hashed, _parent
    cdef vector[double] _delay
    cdef vector[int64_t] _open          # indexes of requests with a fixed arrival time
    cdef priority_queue[pair[double, int64_t]] _released   # (-time, -index): children due
    cdef vector[int64_t] _computed, _gen, _maxcomp, _sched
    cdef vector[int32_t] _slot, _npre
    cdef vector[char] _rstate
    cdef vector[int32_t] _reason
    cdef vector[double] _t_first, _t_done
    cdef vector[vector[int32_t]] _blocks
    cdef vector[vector[uint64_t]] _hashes
    cdef vector[vector[int64_t]] _children
    cdef unordered_map[int64_t, vector[pair[int32_t, uint64_t]]] _sess_blocks
    cdef unordered_map[int64_t, int64_t] _sess_shared   # session -> leading blocks its first request hit
    cdef vector[int32_t] _slot_req, _running, _scheduled
    cdef vector[int32_t] _hit_ids      # the admission candidate's prefix-cache hit blocks
    cdef vector[int32_t] _paused_reqs  # the requests paused this step
    cdef vector[char] _is_paused       # per request
    cdef vector[int64_t] _demoting          # sessions to demote: paused, expired, released (scratch)
    cdef int64_t _next                  # position in _open
    cdef bint _ran, _stepping
    cdef double _horizon                # stepping: no step starts at or after it yet
    cdef vector[double] _retry          # per request: the rejection's Retry-After (-1: none)
    cdef vector[int32_t] _rej_log       # rejected requests, in order
    cdef size_t _rej_taken              # how many of them take_rejections() returned
    # totals
    cdef double _clock, _t0, _kv_block_s, _busy_s, _next_sample
    cdef int64_t _steps, _preemptions, _recomputed, _out_tokens, _prefill_tokens
    cdef int64_t _hit_tokens, _query_tokens, _peak_used, _held_blocks, _batch_tokens
    cdef int64_t _n_done, _n_rejected
    cdef vector[double] _tl_t
    cdef vector[int64_t] _tl_used, _tl_running, _tl_waiting, _tl_preempt, _tl_hit, _tl_query
    cdef vector[double] _tl_window
    cdef int64_t _step_hit, _step_query

    cdef void _extend_request_state(self, Py_ssize_t base)
    cdef uint64_t _block_hash(self, int32_t r, int64_t j) noexcept nogil
    cdef void _release_blocks(self, int32_t r) noexcept nogil
    cdef int64_t _freed_blocks(self, int32_t r) noexcept nogil
    cdef bint _grow(self, int32_t r, int64_t upto_tokens) noexcept nogil
    cdef void _demote_sessions(self, bint window=*) noexcept nogil
    cdef void _demote_session(self, int64_t session) noexcept nogil
    cdef size_t _running_erase(self, int32_t r) noexcept nogil
    cdef void _finish(self, int32_t r, double t) noexcept nogil
    cdef void _release_children(self, int32_t r, double t) noexcept nogil
    cdef void _reject(self, int32_t r, Rejection rej)
    cdef double _next_arrival(self) noexcept nogil
    cdef int32_t _pop_arrival(self) noexcept nogil
    cdef int _arrivals(self) except -1
    cdef int _drop_shed(self, list shed) except -1
    cdef int64_t _prefix_hit_blocks(self, int32_t r, int64_t tokens, int64_t* fresh) noexcept nogil
    cdef bint _is_hit(self, int32_t b) noexcept nogil
    cdef void _sample_timeline(self) noexcept nogil
