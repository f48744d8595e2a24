# The admission policies' C-level API (see _policies.pyx): one Policy subclass
# per policy, each with its own `c_fits`.
from libc.stdint cimport int32_t, int64_t
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._curves cimport Curve
from kvadmit._step_time cimport StepTimeFit
from kvadmit._ledger cimport Ledger
from kvadmit._length_model cimport OutputLengthModel

cdef enum:  # indexes into POLICIES
    P_OVERCOMMIT = 0
    P_RESERVE = 1
    P_PEAK = 2
    P_PREDICT = 3
    P_ADAPTIVE = 4
    P_AUTO = 5        # adaptive's curves, own constants (AUTO_*), prefix sharing discounted


cdef enum:
    REFUSED_CURVES_KEPT = 8   # refused curves a queue scan remembers


cdef class Policy:
    cdef readonly int kind                 # its index in POLICIES
    cdef readonly int64_t priority_margin  # priority_preemption_threshold (the core's priority retraction)
    cdef Ledger ledger
    cdef int64_t num_blocks, block_size
    # The running requests' KV curves, longest first (rebuilt when dirty); every
    # policy has them (peak_blocks() reports them), peak, adaptive and auto admit by them.
    cdef vector[Curve] _profile
    cdef bint _profile_dirty
    cdef vector[int32_t] _fenwick            # scratch for the peak computation
    # SGLang's new_token_ratio, and the running requests' offsets it weighs: predict
    # admits by them; the ratio is tracked (and reported) under every policy.
    cdef readonly double ratio
    cdef double _init_ratio, _min_ratio, _ratio_decay
    cdef int64_t _clip_tokens, _retract_steps
    cdef bint _preempted_this_step
    cdef double _offsets_sum
    cdef bint _offsets_dirty
    # The output-length model, fed by every finish; adaptive and auto predict with it.
    cdef readonly OutputLengthModel lengths
    cdef readonly double quantile          # the length quantile (adaptive and auto move it)
    cdef public StepTimeFit step_time      # the engine's step time (the core's fit; auto prices by it)
    cdef readonly int64_t past_peak        # admissions auto's price let past the peak
    cdef int32_t _priced_in                # the last candidate it let in (counted once admitted)

    # A scan of the waiting queue (the core's next_admissible) asks c_fits of many
    # requests against one running set: curves refused in it refuse every curve at
    # least as long and as large (the peak only grows), without recomputing it.
    cdef vector[Curve] _refused_in_scan
    cdef bint _scanning

    cdef inline void c_scan_begin(self) noexcept nogil:
        self._refused_in_scan.clear()
        self._scanning = True

    cdef inline void c_scan_end(self) noexcept nogil:
        self._scanning = False

    cdef inline bint _covers_refused(self, const Curve& c) noexcept nogil:
        """Whether c is at least one refused curve of this scan, in both steps and tokens."""
        cdef size_t i
        if not self._scanning:
            return False
        for i in range(self._refused_in_scan.size()):
            if self._refused_in_scan[i].steps <= c.steps and self._refused_in_scan[i].tokens <= c.tokens:
                return True
        return False

    cdef inline bint _noted(self, bint fits, const Curve& c) noexcept nogil:
        """Returns fits; remembers c for this scan when refused (a few curves suffice)."""
        if not fits and self._scanning \
                and self._refused_in_scan.size() < REFUSED_CURVES_KEPT:
            self._refused_in_scan.push_back(c)
        return fits

    cdef inline void c_running_changed(self) noexcept nogil:
        """A running request's numbers changed, or the running set did."""
        self._profile_dirty = True
        self._offsets_dirty = True

    cdef bint c_fits(self, int32_t s, int64_t free_blocks) noexcept nogil
    cdef bint c_fits_alone(self, int32_t s) noexcept nogil
    cdef bint c_fits_taking(self, int32_t s, int64_t free_blocks,
                            const vector[char]& takeable) noexcept nogil
    cdef int64_t c_forecast_blocks(self) noexcept nogil
    cdef int64_t c_peak_blocks(self) noexcept nogil
    cdef int64_t c_expected_output(self, int32_t s) noexcept nogil
    cdef int64_t c_soonest_finish(self) noexcept nogil
    cdef void c_on_admit(self, int32_t s) noexcept nogil
    cdef void c_after_admit(self) noexcept nogil
    cdef void c_admission_undone(self) noexcept nogil
    cdef void c_on_preempt(self) noexcept nogil
    cdef void c_on_step(self, bint idle) noexcept nogil
    cdef void c_on_finish(self, int32_t s) noexcept nogil
    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil
    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil
    cdef Curve _curve(self, int32_t s) noexcept nogil
    cdef void _ensure_profile(self) noexcept nogil
    cdef void _profile_insert(self, int32_t s) noexcept nogil
    cdef int64_t _held_blocks(self) noexcept nogil


cdef class OvercommitPolicy(Policy):
    pass


cdef class ReservePolicy(Policy):
    pass


cdef class PeakPolicy(Policy):
    cdef int64_t _shared_term(self) noexcept nogil
    cdef int64_t _margin_term(self, int32_t s) noexcept nogil


cdef class PredictPolicy(Policy):
    cdef double _offsets(self) noexcept nogil
    cdef inline double _offset(self, int32_t s) noexcept nogil


cdef class AdaptivePolicy(PeakPolicy):
    cdef double _quantile_base, _quantile_max, _target_preemption_rate
    cdef int64_t _adapt_interval, _adapt_admits, _adapt_preempts
    cdef int64_t _predict_remaining(self, int32_t s) noexcept nogil
    cdef int32_t _lane(self, int32_t s) noexcept nogil
    cdef void _observe_length(self, int32_t s) noexcept nogil


cdef class AutoPolicy(AdaptivePolicy):
    cdef deque[pair[int64_t, char]] _capped_window   # each recent finish: its max_tokens, whether it ran to it
    cdef int64_t _n_capped            # how many in _capped_window did
    cdef unordered_map[int64_t, pair[int64_t, int64_t]] _by_cap   # max_tokens -> (finishes, capped) in the window
    cdef int64_t _unowned_blocks      # blocks in use that no running request's own part counts
    cdef int64_t _max_shared_blocks   # the longest prefix a running request shares, in blocks
    cdef bint _pauseless              # the engine cannot pause (shortfall "preempt")
    cdef bint _priced                 # the engine prices its shortfalls (auto's own: kvadmit._shortfall)
    cdef double _cap_honesty(self, int64_t max_new) noexcept nogil
    cdef int64_t _growth_floor(self, int32_t s, int64_t r) noexcept nogil
    cdef int64_t _overrun(self, int32_t s) noexcept nogil
    cdef bint _overflow_pays(self, const Curve& c, int64_t room) noexcept nogil


cdef Policy make_policy(config, Ledger ledger, int64_t num_blocks, int64_t max_model_len)
