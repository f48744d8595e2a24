# One request's numbers as the core takes them at arrival: the arrival record.
# Defined once, here; the Python twin kvadmit.arrival.ArrivalRecord is made from it
# (its fields in order, with _arrival.pyx's DEFAULTS), and kvadmit._requests.Requests
# holds one per request of a workload. A new per-request field is one line here, its
# default and range in _arrival.pyx, its Field in kvadmit.request_fields.SCHEMA (if
# a client sends it) and the rule that reads it (Ledger.record).
from libc.stdint cimport int64_t


cdef struct ArrivalRecord:
    int64_t prompt_tokens     # prompt tokens (>= 1)
    int64_t max_new_tokens    # its output cap (>= 0; 0: a pooling request, which never decodes)
    int64_t priority          # lower is more important (vLLM's order); 0: the default
    int64_t cached_tokens     # prompt tokens already cached, in [0, prompt_tokens]
    double ttft_slo_s         # TTFT target, seconds (negative: the config's default; 0: none)
    double tpot_slo_s         # TPOT target, seconds (the same)
    int64_t session           # its agent/session id (-1: none)
    double arrival_time       # the engine's own arrival stamp (any clock), and its
    double arrival_tie        # tie-break: the order of equal priorities (queue_order priority)
    double ttl_s              # seconds it may wait before it first starts; past it, it is
                              # dropped unserved (negative: the config's max_queue_age_s; 0: none)
    int64_t flow              # its flow (tenant, workload) for the fair share (-1: none)
    bint sheddable            # best-effort: served after all others, first to give way, and
                              # dropped while others wait for KV (GIE's negative priority)
    int64_t prompt_hash       # a hash of its prompt's tokens (0: unknown): a retry repeats it,
                              # a new client with the same numbers seldom does (the retry line)
    double max_queue_delay_s  # its own cap on its predicted queueing delay at arrival, seconds
                              # (<= 0: the config's max_queue_delay_s alone; else the tighter)
    double kv_hold_s          # seconds its session is expected back after it ends: past it the
                              # session's cached KV is evicted first (0: the session is done;
                              # negative: none given, the free queue's own order)


cdef ArrivalRecord record_of(object record) except *
cdef int check_record(const ArrivalRecord* r, Py_ssize_t row=*) except -1
