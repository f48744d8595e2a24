# The admission policies: when may a waiting request start, given the running ones?
#
# Each policy is a Policy subclass with its own rule, `c_fits(s, free_blocks)`,
# asked after the core found the blocks the request needs now (or left that to
# the engine):
#   overcommit  always (vLLM's default: preempt when the pool runs out);
#   reserve     the blocks of every running request's prompt + max_tokens, and
#               the candidate's, fit the pool;
#   peak        the exact peak of the running requests' KV curves with the
#               candidate's (kvadmit._curves), each running to its max_tokens, fits;
#   predict     SGLang's rule: the candidate's prefill plus clipped max_tokens fit
#               the free tokens less the running requests' offsets (their remaining
#               tokens times new_token_ratio);
#   adaptive    peak with each request's remaining output predicted by a quantile
#               of recent output lengths (a flow's, once it has enough), the
#               quantile raised after preemptions;
#   auto        adaptive with fixed settings, caps learned to be honest or not (per
#               max_tokens value), and prefixes shared by running requests counted
#               once; on an engine without pause (SGLang), a higher length quantile,
#               growth no less than SGLang's own estimate and room for the largest
#               single overrun.
# `c_fits_taking` is `c_fits` with the KV of the running requests the core marks
# takeable counted as free: what they hold and their growth (the core's priority
# retraction and the flows' displacement, kvadmit._decision).
# `c_fits_alone` asks whether a request could ever run on this pool (else the core
# refuses it at arrival); `c_forecast_blocks` is the policy's forecast of the
# running requests' peak, for router signals.

from cython.operator cimport dereference as deref, preincrement as inc
from libc.math cimport ceil
from libc.stdint cimport INT64_MAX, int32_t, int64_t
from libcpp.algorithm cimport sort
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._curves cimport Curve, cdiv, curve_longer, first_over_sorted, peak_blocks_sorted
from kvadmit._ledger cimport Ledger
from kvadmit._length_model cimport OutputLengthModel, c_next_quantile
from kvadmit._shortfall cimport ShortfallCosts, shortfall_costs

POLICIES = ("overcommit", "reserve", "peak", "predict", "adaptive", "auto")

# `auto`: the zero-config default. Its length quantile and controller settings are
# fixed here (not the adaptive_* keys): one setting for every workload.
cdef double AUTO_QUANTILE = 0.4          # starting (and lowest) quantile of the output-length model
# Without pause (SGLang) a request that outruns its prediction costs a retraction (its
# KV recomputed), not a step sat out: the quantile starts higher (a newsvendor's
# critical ratio of about 4 to 1). At 0.4 light-tailed lengths (uniform, bimodal) left
# several running requests long at once and retracted where SGLang's own rule did not.
cdef double AUTO_PAUSELESS_QUANTILE = 0.8
cdef double AUTO_MAX_QUANTILE = 0.95     # ceiling the controller may raise it to
cdef double AUTO_TARGET_PREEMPTION_RATE = 0.01   # preemptions per admission that raise it
# A max_tokens value's own finishes outweigh the share of all finishes once there are
# more than this many of them (AutoPolicy._cap_honesty).
cdef double CAP_PRIOR_FINISHES = 2.0
cdef enum:
    AUTO_MIN_SAMPLES = 1     # finished lengths before predictions replace max_tokens
    AUTO_INTERVAL = 64       # admissions per controller window
    # A flow's own lengths predict its requests once it has this many (before: all
    # flows' lengths); flows numbered past FLOW_LENGTH_LANES share lane 0, so that
    # ids from a header cannot grow the model without bound.
    FLOW_MIN_SAMPLES = 16
    FLOW_LENGTH_LANES = 64
    FLOW_LANE_WINDOW = 4096  # lengths a flow's lane keeps at most (adaptive_window's default)


cdef Policy make_policy(config, Ledger ledger, int64_t num_blocks, int64_t max_model_len):
    """The policy `config.policy` names, over this ledger and pool."""
    cls = (OvercommitPolicy, ReservePolicy, PeakPolicy, PredictPolicy, AdaptivePolicy,
           AutoPolicy)[POLICIES.index(config.policy)]
    return cls(config, ledger, num_blocks, max_model_len)


cdef class Policy:
    """What every policy shares: the running set's curves and the ratio and length
    model it reports. A subclass is one policy: its `c_fits` and the hooks it needs."""

    def __init__(self, config, Ledger ledger, int64_t num_blocks, int64_t max_model_len,
                 int64_t min_samples=-1):
        self.kind = POLICIES.index(config.policy)
        self.priority_margin = config.priority_preemption_threshold
        self.ledger = ledger
        self.num_blocks = num_blocks
        self.block_size = ledger.block_size
        self._fenwick.assign(self.block_size + 1, 0)
        self._profile_dirty = True
        self._offsets_dirty = True
        self._init_ratio = config.predict_init_ratio
        self._min_ratio = config.predict_init_ratio * config.predict_min_ratio_factor
        self._ratio_decay = (self._init_ratio - self._min_ratio) / config.predict_decay_steps
        self._clip_tokens = config.predict_clip_tokens
        self._retract_steps = config.predict_retract_steps
        self.ratio = self._init_ratio
        self._preempted_this_step = False
        self.quantile = config.adaptive_quantile
        self.past_peak = 0
        self._priced_in = -1
        self.lengths = OutputLengthModel(
            config.adaptive_bucket_tokens,
            max_model_len if max_model_len > 0 else num_blocks * self.block_size,
            config.adaptive_window,
            min_samples if min_samples > 0 else config.adaptive_min_samples,
            FLOW_LANE_WINDOW)

    # --- the rule --------------------------------------------------------
    cdef bint c_fits(self, int32_t s, int64_t free_blocks) noexcept nogil:
        """May waiting request s start beside the running ones?"""
        return True

    cdef bint c_fits_taking(self, int32_t s, int64_t free_blocks,
                            const vector[char]& takeable) noexcept nogil:
        """May s start if every running request marked in `takeable` (by position in
        the ledger's running set) gave back its KV, the blocks it holds and those it
        would still take? (overcommit: c_fits admits always.)"""
        return True

    cdef bint c_fits_alone(self, int32_t s) noexcept nogil:
        """Could s ever run on this pool? Every policy that admits by curves or
        runs it once it fits alone asks its worst-case curve to."""
        cdef Curve c
        c.tokens = self.ledger.tokens(s)
        c.steps = self.ledger.worst_steps(s) + self.ledger.prefill_extra_steps(s)
        return peak_blocks_sorted(NULL, 0, &c, self.block_size, self.num_blocks,
                                  self._fenwick) <= self.num_blocks

    cdef int64_t c_forecast_blocks(self) noexcept nogil:
        """Blocks the running requests will hold at most, as this policy forecasts
        it (overcommit: what they hold now)."""
        return self._held_blocks()

    cdef int64_t _held_blocks(self) noexcept nogil:
        cdef int64_t held = 0
        cdef size_t i
        for i in range(self.ledger.n_running()):
            held += cdiv(self.ledger.computed(self.ledger.running_at(i)), self.block_size)
        return held

    # --- curves ----------------------------------------------------------
    cdef Curve _curve(self, int32_t s) noexcept nogil:
        """s's KV curve: its tokens now, running to its max_tokens."""
        cdef Curve c
        c.tokens = self.ledger.tokens(s)
        c.steps = self.ledger.worst_steps(s) + self.ledger.prefill_extra_steps(s)
        return c

    cdef void _ensure_profile(self) noexcept nogil:
        if not self._profile_dirty:
            return
        self._profile.clear()
        cdef size_t i
        for i in range(self.ledger.n_running()):
            self._profile.push_back(self._curve(self.ledger.running_at(i)))
        sort(self._profile.begin(), self._profile.end(), curve_longer)
        self._profile_dirty = False

    cdef void _profile_insert(self, int32_t s) noexcept nogil:
        if self._profile_dirty:
            return
        cdef Curve c = self._curve(s)
        cdef vector[Curve].iterator it = self._profile.begin()
        while it != self._profile.end() and deref(it).steps >= c.steps:
            inc(it)
        self._profile.insert(it, c)

    cdef int64_t c_peak_blocks(self) noexcept nogil:
        """Peak blocks the running requests reach under this policy's curves."""
        self._ensure_profile()
        return peak_blocks_sorted(self._profile.data(), self._profile.size(), NULL,
                                  self.block_size, INT64_MAX, self._fenwick)

    cdef int64_t c_expected_output(self, int32_t s) noexcept nogil:
        """Output tokens s is expected to add (its max_tokens; adaptive predicts)."""
        return self.ledger.max_new(s) - self.ledger.generated(s)

    cdef int64_t c_soonest_finish(self) noexcept nogil:
        """Steps until the running request expected to finish first does (-1: none runs)."""
        cdef int64_t w, best = -1
        cdef size_t k
        cdef int32_t s
        for k in range(self.ledger.n_running()):
            s = self.ledger.running_at(k)
            w = self.c_expected_output(s) + self.ledger.prefill_extra_steps(s)
            if best < 0 or w < best:
                best = w
        return best

    # --- what the core reports -------------------------------------------
    cdef void c_on_admit(self, int32_t s) noexcept nogil:
        """s started running (the ledger has it in the running set)."""
        self._profile_insert(s)
        self._offsets_dirty = True

    cdef void c_after_admit(self) noexcept nogil:
        """The admission is counted (adaptive's controller looks now)."""
        pass

    cdef void c_admission_undone(self) noexcept nogil:
        pass

    cdef void c_on_preempt(self) noexcept nogil:
        """A running request was preempted (it has left the running set). SGLang:
        after a retraction the ratio is re-estimated from the requests kept."""
        self._preempted_this_step = True
        cdef double gen = 0.0, mx = 0.0
        cdef size_t i
        for i in range(self.ledger.n_running()):
            gen += self.ledger.generated(self.ledger.running_at(i))
            mx += self.ledger.max_new(self.ledger.running_at(i))
        self.ratio = min(1.0, (gen + self._retract_steps * <double>self.ledger.n_running()) / (mx + 1.0))

    cdef void c_on_step(self, bint idle) noexcept nogil:
        """An engine step ended (`idle`: nothing runs or waits): the ratio decays
        toward its minimum unless the step preempted."""
        if idle:
            self.ratio = self._init_ratio
        elif not self._preempted_this_step:
            self.ratio = max(self.ratio - self._ratio_decay, self._min_ratio)
        self._preempted_this_step = False
        self._offsets_dirty = True

    cdef void c_on_finish(self, int32_t s) noexcept nogil:
        """s finished (it has left the running set): its length feeds the model."""
        self.lengths.c_observe(self.ledger.generated(s))

    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil:
        pass

    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil:
        pass


cdef class OvercommitPolicy(Policy):
    """Admits whatever fits now (the core checks the blocks): vLLM's default."""


cdef class ReservePolicy(Policy):
    """Every running request may reach its max_tokens: reserve it all up front."""

    cdef bint c_fits(self, int32_t s, int64_t free_blocks) noexcept nogil:
        return self.ledger.reserve_load() + self.ledger.reserve_blocks(s) <= self.num_blocks

    cdef bint c_fits_alone(self, int32_t s) noexcept nogil:
        return self.ledger.reserve_blocks(s) <= self.num_blocks

    cdef bint c_fits_taking(self, int32_t s, int64_t free_blocks,
                            const vector[char]& takeable) noexcept nogil:
        cdef int64_t lower = 0
        cdef size_t i
        for i in range(self.ledger.n_running()):
            if takeable[i]:
                lower += self.ledger.reserve_blocks(self.ledger.running_at(i))
        return self.ledger.reserve_load() - lower + self.ledger.reserve_blocks(s) <= self.num_blocks

    cdef int64_t c_forecast_blocks(self) noexcept nogil:
        return self.ledger.reserve_load()


cdef class PeakPolicy(Policy):
    """The peak rule: the exact peak of the running requests' KV curves with the
    candidate's (each running to its max_tokens) fits the pool."""

    cdef bint c_fits(self, int32_t s, int64_t free_blocks) noexcept nogil:
        self._ensure_profile()
        cdef Curve c = self._curve(s)
        if self._covers_refused(c):
            return False
        return self._noted(peak_blocks_sorted(self._profile.data(), self._profile.size(), &c,
                                              self.block_size, self.num_blocks, self._fenwick)
                           + self._shared_term() + self._margin_term(s) <= self.num_blocks, c)

    cdef bint c_fits_taking(self, int32_t s, int64_t free_blocks,
                            const vector[char]& takeable) noexcept nogil:
        """The peak of the curves of s and of the running requests not takeable fits
        (the takeable ones are left out)."""
        cdef vector[Curve] kept
        cdef size_t i
        for i in range(self.ledger.n_running()):
            if not takeable[i]:
                kept.push_back(self._curve(self.ledger.running_at(i)))
        sort(kept.begin(), kept.end(), curve_longer)
        cdef Curve c = self._curve(s)
        return peak_blocks_sorted(kept.data(), kept.size(), &c, self.block_size, self.num_blocks,
                                  self._fenwick) + self._shared_term() + self._margin_term(s) \
            <= self.num_blocks

    cdef int64_t c_forecast_blocks(self) noexcept nogil:
        return self.c_peak_blocks() + self._shared_term()

    cdef int64_t _shared_term(self) noexcept nogil:
        """Blocks added to the running curves' peak: none here (auto adds its shared
        prefixes)."""
        return 0

    cdef int64_t _margin_term(self, int32_t s) noexcept nogil:
        """Blocks added to the peak when candidate s is judged: none here (auto, on an
        engine without pause, adds its single-failure margin)."""
        return 0


cdef class PredictPolicy(Policy):
    """SGLang's rule: admit while prompt + clipped max_new < free tokens - running offsets."""

    cdef bint c_fits(self, int32_t s, int64_t free_blocks) noexcept nogil:
        return <double>(self.ledger.queued_of(s) + min(self.ledger.max_new(s) - self.ledger.generated(s), self._clip_tokens)) \
            < free_blocks * self.block_size - self._offsets()

    cdef bint c_fits_alone(self, int32_t s) noexcept nogil:
        if self.ledger.queued_of(s) + min(self.ledger.max_new(s), self._clip_tokens) >= self.num_blocks * self.block_size:
            return False  # its own rule would hold it even on an empty pool
        return Policy.c_fits_alone(self, s)

    cdef int64_t c_forecast_blocks(self) noexcept nogil:
        return self._held_blocks() + <int64_t>ceil(self._offsets() / self.block_size)

    cdef bint c_fits_taking(self, int32_t s, int64_t free_blocks,
                            const vector[char]& takeable) noexcept nogil:
        """SGLang's rule with the blocks of the takeable running requests free and
        their offsets gone."""
        cdef int64_t held = 0
        cdef double offsets = self._offsets()
        cdef int32_t r
        cdef size_t i
        for i in range(self.ledger.n_running()):
            r = self.ledger.running_at(i)
            if takeable[i]:
                held += cdiv(self.ledger.computed(r), self.block_size)
                offsets -= self._offset(r)
        return <double>(self.ledger.queued_of(s) + min(self.ledger.max_new(s) - self.ledger.generated(s), self._clip_tokens)) \
            < (free_blocks + held) * self.block_size - offsets

    cdef double _offsets(self) noexcept nogil:
        cdef size_t i
        if self._offsets_dirty:
            self._offsets_sum = 0.0
            for i in range(self.ledger.n_running()):
                self._offsets_sum += self._offset(self.ledger.running_at(i))
            self._offsets_dirty = False
        return self._offsets_sum

    cdef inline double _offset(self, int32_t s) noexcept nogil:
        cdef int64_t rem = self.ledger.max_new(s) - self.ledger.generated(s)
        if rem < 0:
            rem = 0
        if rem > self._clip_tokens:
            rem = self._clip_tokens
        # Admitted this step: charged in full, as SGLang's PrefillAdder does.
        return <double>rem if self.ledger.admit_step(s) == self.ledger.step() else rem * self.ratio


cdef class AdaptivePolicy(PeakPolicy):
    """The peak rule over predicted curves: each request's remaining output is the
    q-quantile of recent output lengths given its length so far (its flow's own,
    `_lane`); q rises after a window of admissions with too many preemptions and
    relaxes after none."""

    def __init__(self, config, Ledger ledger, int64_t num_blocks, int64_t max_model_len,
                 int64_t min_samples=-1):
        PeakPolicy.__init__(self, config, ledger, num_blocks, max_model_len, min_samples)
        self._quantile_base = config.adaptive_quantile
        self._quantile_max = config.adaptive_max_quantile
        self._target_preemption_rate = config.adaptive_target_preemption_rate
        self._adapt_interval = config.adaptive_interval
        self._adapt_admits = self._adapt_preempts = 0

    cdef Curve _curve(self, int32_t s) noexcept nogil:
        cdef Curve c
        c.tokens = self.ledger.tokens(s)
        c.steps = self._predict_remaining(s) + self.ledger.prefill_extra_steps(s)
        return c

    cdef int64_t _predict_remaining(self, int32_t s) noexcept nogil:
        """Output tokens still to come, as the length model predicts them."""
        return self.lengths.c_predict_remaining(self.ledger.generated(s), self.ledger.max_new(s),
                                                self.quantile, self._lane(s))

    cdef int32_t _lane(self, int32_t s) noexcept nogil:
        """The length model's lane that predicts s: its flow's, once that flow has
        FLOW_MIN_SAMPLES lengths (a tenant's or a workload's requests end alike: a
        chat flow's short answers, a batch flow's long ones), else every flow's."""
        cdef int32_t f = self.ledger.flow_ix(s)
        if f <= 0 or f >= FLOW_LENGTH_LANES or self.lengths.c_samples(f) < FLOW_MIN_SAMPLES:
            return 0
        return f

    cdef void _observe_length(self, int32_t s) noexcept nogil:
        """s's output length feeds lane 0 (every request's) and its flow's lane."""
        cdef int32_t f = self.ledger.flow_ix(s)
        self.lengths.c_observe(self.ledger.generated(s))
        if 0 < f < FLOW_LENGTH_LANES:
            self.lengths.c_observe(self.ledger.generated(s), f)

    cdef void c_on_finish(self, int32_t s) noexcept nogil:
        self._observe_length(s)

    cdef int64_t c_expected_output(self, int32_t s) noexcept nogil:
        return self._predict_remaining(s)

    cdef void c_after_admit(self) noexcept nogil:
        self._adapt_admits += 1
        if self._adapt_admits < self._adapt_interval:
            return
        self.quantile = c_next_quantile(self.quantile, self._quantile_base, self._quantile_max,
                                        self._adapt_preempts, self._adapt_admits,
                                        self._target_preemption_rate)
        self._adapt_admits = 0
        self._adapt_preempts = 0
        self._profile_dirty = True

    cdef void c_admission_undone(self) noexcept nogil:
        if self._adapt_admits > 0:
            self._adapt_admits -= 1

    cdef void c_on_preempt(self) noexcept nogil:
        self._adapt_preempts += 1
        PeakPolicy.c_on_preempt(self)


cdef class AutoPolicy(AdaptivePolicy):
    """adaptive with fixed settings (AUTO_*), plus: how often requests run to their
    max_tokens (honest caps) is learned, per max_tokens value (only the lengths of
    requests that stopped before it feed the length model), and prefixes running
    requests share are counted once. On an engine without pause (SGLang) two more
    terms: each request's predicted growth is at least SGLang's own estimate
    (`_growth_floor`), and the peak keeps room for the largest single overrun
    (`_margin_term`)."""

    def __init__(self, config, Ledger ledger, int64_t num_blocks, int64_t max_model_len,
                 int64_t min_samples=-1):
        AdaptivePolicy.__init__(self, config, ledger, num_blocks, max_model_len, AUTO_MIN_SAMPLES)
        # An engine that cannot pause (shortfall "preempt": SGLang) pays for a short
        # prediction with a retraction (the request's KV recomputed), not a step sat out.
        self._pauseless = not config.pause_on_shortfall
        self._priced = config.pause_on_shortfall and config.shortfall == "cost"
        self._quantile_base = AUTO_PAUSELESS_QUANTILE if self._pauseless else AUTO_QUANTILE
        self._quantile_max = AUTO_MAX_QUANTILE
        self._target_preemption_rate, self._adapt_interval = AUTO_TARGET_PREEMPTION_RATE, AUTO_INTERVAL
        self.quantile = self._quantile_base
        self._n_capped = 0
        self._unowned_blocks = self._max_shared_blocks = 0

    cdef bint c_fits(self, int32_t s, int64_t free_blocks) noexcept nogil:
        """The peak rule. Where the engine prices its shortfalls (`_priced`), also:
        a request preempted before starts again once its blocks fit now (as vLLM
        resumes one: its stream has stalled, and the shortfall's price already chose
        to recompute it), and a new one starts past the peak where that pays
        (`_overflow_pays`)."""
        self._priced_in = -1
        if self._priced and self.ledger.preempts(s) > 0:
            return True
        if PeakPolicy.c_fits(self, s, free_blocks):
            return True
        if not self._priced or self.step_time is None:
            return False
        cdef Curve c = self._curve(s)
        if not self._overflow_pays(c, self.num_blocks - self._shared_term() - self._margin_term(s)):
            return False
        self._priced_in = s
        return True

    cdef bint _overflow_pays(self, const Curve& c, int64_t room) noexcept nogil:
        """Admitting c's request past the peak. Until the first step t at which the
        running curves with c would not fit, it runs on pool that would otherwise
        sit idle: each block-step a pool's share of a step's time (T / num_blocks,
        T this step's predicted time with it in). At t the engine recomputes it
        (or someone the shortfall's price finds cheaper): its tokens then, (b + c)
        seconds each. Pays where the first exceeds the second."""
        cdef int64_t t = first_over_sorted(self._profile.data(), self._profile.size(), &c,
                                           self.block_size, room, self._fenwick)
        if t <= 0:
            return False
        cdef double step_s = self.step_time.c_predict(
            <double>(self.ledger.n_running() + 1),
            <double>(self.ledger.running_context() + c.tokens))
        cdef double idle_used = step_s * t * (c.tokens + 0.5 * t) / self.block_size / self.num_blocks
        cdef ShortfallCosts price = shortfall_costs(self.step_time, 1)
        return idle_used > (price.b + price.c) * (c.tokens + t)

    cdef void c_on_admit(self, int32_t s) noexcept nogil:
        if s == self._priced_in:
            self.past_peak += 1
        self._priced_in = -1
        AdaptivePolicy.c_on_admit(self, s)

    cdef Curve _curve(self, int32_t s) noexcept nogil:
        cdef Curve c
        c.tokens = self.ledger.tokens(s) - self.ledger.shared(s)   # counted once, in _unowned_blocks
        c.steps = self._predict_remaining(s) + self.ledger.prefill_extra_steps(s)
        return c

    cdef int64_t _predict_remaining(self, int32_t s) noexcept nogil:
        """A request stops at its cap with probability h (learned per max_tokens
        value: _cap_honesty), else at a length from the model of the requests that
        stopped earlier; the q-quantile of that mixture is the cap when h >= 1 - q,
        else the model's q / (1 - h) quantile. So honest caps give peak's exact
        curves, and caps far above the lengths give the length model's."""
        cdef double h, survive, q = self.quantile
        cdef int32_t lane = self._lane(s)
        if self._capped_window.size() > 0:
            h = self._cap_honesty(self.ledger.max_new(s))
            if h > 0.0:
                # Still running after g tokens: it runs to its cap with probability
                # h / (h + (1 - h) S(g)), S(g) the share of early stoppers longer than g.
                survive = self.lengths.c_survival(self.ledger.generated(s), lane)
                h = h / (h + (1.0 - h) * survive) if survive >= 0.0 else 1.0
            if h >= 1.0 - q:
                return self.ledger.worst_steps(s)
            q = q / (1.0 - h)
        cdef int64_t r = self.lengths.c_predict_remaining(self.ledger.generated(s),
                                                          self.ledger.max_new(s), q, lane)
        return self._growth_floor(s, r) if self._pauseless else r

    cdef double _cap_honesty(self, int64_t max_new) noexcept nogil:
        """How often a request with this max_tokens runs to it: the share of recent
        finishes with the same max_tokens that did, shrunk towards the share of all
        recent finishes by CAP_PRIOR_FINISHES of them. Clients set max_tokens alike
        when their requests end alike (an honest cap from one, a slack default from
        another); with one max_tokens for all it is the share of all finishes."""
        cdef double overall = self._n_capped / <double>self._capped_window.size()
        cdef unordered_map[int64_t, pair[int64_t, int64_t]].iterator it = self._by_cap.find(max_new)
        if it == self._by_cap.end():
            return overall
        return (deref(it).second.second + CAP_PRIOR_FINISHES * overall) \
            / (deref(it).second.first + CAP_PRIOR_FINISHES)

    cdef int64_t _growth_floor(self, int32_t s, int64_t r) noexcept nogil:
        """Without pause: no less than SGLang's own estimate of s's growth, its
        new_token_ratio (tracked here as the predict policy's `ratio`: 0.7 at first,
        decaying, re-estimated after a retraction) times its clipped remaining
        max_tokens. The length model's quantile then only adds to what SGLang expects,
        and while the model knows few lengths (the first to finish are the short ones)
        SGLang's estimate holds."""
        cdef int64_t rem = self.ledger.max_new(s) - self.ledger.generated(s)
        if rem > self._clip_tokens:
            rem = self._clip_tokens
        cdef int64_t g = <int64_t>ceil(self.ratio * rem)
        return g if g > r else r

    cdef int64_t _margin_term(self, int32_t s) noexcept nogil:
        """Without pause: the blocks of the largest overrun any one request (a running
        one or the candidate s) may still have, its max_tokens less its predicted
        remaining. The peak then fits even if that one runs to its cap (a single
        misprediction costs no retraction), as SGLang's own rule keeps room for a
        new request's whole max_new. None on an empty pool: a request alone runs on
        its worst case (c_fits_alone), and holding it there would hold it forever."""
        if not self._pauseless or self.ledger.n_running() == 0:
            return 0
        cdef int64_t worst = self._overrun(s), e
        cdef size_t i
        for i in range(self.ledger.n_running()):
            e = self._overrun(self.ledger.running_at(i))
            if e > worst:
                worst = e
        return cdiv(worst, self.block_size)

    cdef int64_t _overrun(self, int32_t s) noexcept nogil:
        cdef int64_t e = self.ledger.worst_steps(s) - self._predict_remaining(s)
        return e if e > 0 else 0

    cdef void c_on_step(self, bint idle) noexcept nogil:
        AdaptivePolicy.c_on_step(self, idle)
        if self._pauseless:
            self._profile_dirty = True   # the ratio moved: the growth floors with it

    cdef void c_on_preempt(self) noexcept nogil:
        AdaptivePolicy.c_on_preempt(self)
        if self._pauseless:
            self._profile_dirty = True

    cdef int64_t _shared_term(self) noexcept nogil:
        """Blocks auto adds to the own curves: those in use that no running request
        owns, and at least the longest shared prefix. A prefix stays in use while any
        request sharing it runs, also after its first holder (whose own curve counts
        it) finishes; until then it is in no one's unowned count. (With several
        distinct shared prefixes whose first holders still run, only the longest is
        covered so.)"""
        return self._unowned_blocks if self._unowned_blocks > self._max_shared_blocks \
            else self._max_shared_blocks

    cdef void c_on_finish(self, int32_t s) noexcept nogil:
        cdef int64_t cap = self.ledger.max_new(s)
        cdef bint capped = self.ledger.generated(s) >= cap
        cdef pair[int64_t, int64_t]* counts = &self._by_cap[cap]   # (finishes, capped)
        cdef pair[int64_t, char] gone
        self._capped_window.push_back(pair[int64_t, char](cap, capped))
        self._n_capped += capped
        counts.first += 1
        counts.second += capped
        if <int64_t>self._capped_window.size() > self.lengths.c_window():   # the same window
            gone = self._capped_window.front()
            self._capped_window.pop_front()
            self._n_capped -= gone.second
            counts = &self._by_cap[gone.first]
            counts.first -= 1
            counts.second -= gone.second
            if counts.first == 0:
                self._by_cap.erase(gone.first)
        if not capped:
            self._observe_length(s)

    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil:
        """Blocks in use beyond the running requests' own parts (their context less the
        prefix they share): the shared prefixes, counted once and assumed held while
        anything runs. A request's curve counts only its own part, so a prefix many
        requests share is not counted once per request (peak and adaptive count it
        per request: their bound stays a bound)."""
        cdef int64_t own = 0, shared
        cdef size_t i
        cdef int32_t r
        self._max_shared_blocks = 0
        for i in range(self.ledger.n_running()):
            r = self.ledger.running_at(i)
            shared = self.ledger.shared(r) // self.block_size
            own += cdiv(self.ledger.computed(r), self.block_size) - shared
            if shared > self._max_shared_blocks:
                self._max_shared_blocks = shared
        self._unowned_blocks = used_blocks - own if used_blocks > own else 0

    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil:
        """s's prompt tokens in blocks other running requests hold (only auto keeps
        them: the ledger's `shared`, which its curves discount)."""
        if self.ledger.shared(s) == shared_tokens:
            return
        self.ledger.set_shared(s, shared_tokens)
        if shared_tokens // self.block_size > self._max_shared_blocks:
            self._max_shared_blocks = shared_tokens // self.block_size
        self._profile_dirty = True
