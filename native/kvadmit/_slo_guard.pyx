# The SLO guard: admission that keeps latency targets.
#
# TTFT: an arrival is refused when its predicted time to first token (the later
# of prefilling everything ahead of it under the step-time model and the queue's
# recent drain pace, plus its own prefill) exceeds its target. TPOT: a waiting
# request is held while admitting it would make a decode step slower than the
# tightest TPOT target among the running requests and itself. Both predict with
# an online step-time fit (kvadmit._step_time) that the engine's steps refine.

from cython.operator cimport dereference as deref
from libc.math cimport ceil
from libc.stdint cimport int32_t, int64_t
from libcpp.map cimport map as cmap

from kvadmit._step_time cimport StepTimeFit


cdef class SloGuard:
    """The SLO guard of one core (``config.slo_guard``; disabled it holds nothing, but
    the step-time fit still learns, for stats)."""

    def __init__(self, config):
        self.enabled = config.slo_guard
        self._default_ttft_s = config.default_ttft_slo_s
        self._default_tpot_s = config.default_tpot_slo_s
        self.step_time = StepTimeFit(config.step_time_a, config.step_time_b, config.step_time_c,
                                     config.step_time_forgetting)
        self._step_budget = 0
        self._ema_step_tokens = 0.0

    cdef void c_started(self, double tpot) noexcept nogil:
        """A request with TPOT target `tpot` (0: none) starts running."""
        if tpot > 0:
            self._tpot_running[tpot] += 1

    cdef void c_stopped(self, double tpot) noexcept nogil:
        cdef cmap[double, int32_t].iterator it
        if tpot > 0:
            it = self._tpot_running.find(tpot)
            deref(it).second -= 1
            if deref(it).second == 0:
                self._tpot_running.erase(it)

    cdef bint c_tpot_ok(self, double tpot, double running, double context) noexcept nogil:
        """The TPOT guard for a candidate with target `tpot`: with it running, a decode
        step over `running` requests (the candidate not counted) and `context` tokens
        (the candidate's counted) stays within the tightest target (always true with
        nothing running)."""
        if not self.enabled or running == 0:
            return True
        cdef double target = tpot
        if not self._tpot_running.empty() and (target <= 0 or deref(self._tpot_running.begin()).first < target):
            target = deref(self._tpot_running.begin()).first
        if target <= 0:
            return True
        # Steps carry others' prefill chunks too: use the recent tokens per step.
        cdef double tokens = running + 1.0
        if self._ema_step_tokens + 1.0 > tokens:
            tokens = self._ema_step_tokens + 1.0
        return self.step_time.c_predict(tokens, context) <= target

    cdef double _prefill_time(self, double q, double r, double ctx) noexcept nogil:
        """Steps (and their time) to prefill q tokens beside r decoding requests."""
        cdef double per_step = (self._step_budget - r) if self._step_budget > 0 else q
        if per_step < 1.0:
            per_step = 1.0
        cdef double n = ceil(q / per_step) if q > 0 else 1.0
        cdef double chunk = q / n
        return n * self.step_time.c_predict(r + chunk, ctx + chunk)

    cdef double c_predict_ttft(self, int64_t ahead_tokens, int64_t queued, double drain,
                               double running, double context) noexcept nogil:
        """The TTFT of a request arriving now behind `ahead_tokens` of waiting prefill,
        predicted for when it would run (Mooncake): the later of (a) prefilling all of
        it and itself under the step-time model beside `running` requests over
        `context` tokens and (b) the queue draining at the recent admission pace
        (`drain`, the arrival gate's predicted delay; 0: none known), plus its own
        prefill."""
        cdef double compute = self._prefill_time(ahead_tokens + queued, running, context)
        if drain > 0:
            drain += self._prefill_time(queued, running, context)
        return compute if compute > drain else drain

    cdef void c_set_step_budget(self, int64_t tokens) noexcept nogil:
        self._step_budget = tokens

    cdef void c_observe_step(self, double tokens, double context, double seconds) noexcept nogil:
        """An engine step took `seconds` for `tokens` scheduled tokens over `context`."""
        self.step_time.c_observe(tokens, context, seconds)
        self._ema_step_tokens += 0.05 * (tokens - self._ema_step_tokens)

    def observe_step(self, double tokens, double context, double seconds):
        """`c_observe_step`, its numbers checked (ValueError naming the field)."""
        self.step_time.observe(tokens, context, seconds)
        self._ema_step_tokens += 0.05 * (tokens - self._ema_step_tokens)
