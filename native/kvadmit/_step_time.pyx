# The SLO guard's step-time model: how long an engine step takes for its
# scheduled tokens and context, fitted online. Small, pure and exact so the core
# (and the tests) can drive it with injected numbers.

from libc.math cimport isfinite, sqrt
from libc.stdint cimport int64_t

cdef double[3] _FEATURE_SCALE = [1.0, 1.0 / 1024.0, 1.0 / 65536.0]


cdef class StepTimeFit:
    """T = a + b * tokens + c * context, fitted online by recursive least squares
    with forgetting. Starts from given (a, b, c); ``prior_std_s`` (seconds per
    normalised feature: 1, tokens / 1024, context / 65536) sets how much that
    start weighs: at 1.0 about one observed step, so real steps take over at once
    and the preset only answers until they arrive."""

    def __init__(self, double a, double b, double c, double forgetting=0.995,
                 double prior_std_s=1.0):
        for name, v in (("a", a), ("b", b), ("c", c)):
            if not (isfinite(v) and v >= 0.0):
                raise ValueError(f"step time {name}={v}: must be a finite number >= 0")
        if not (0.5 <= forgetting <= 1.0):
            raise ValueError(f"forgetting={forgetting}: must be in [0.5, 1]")
        if not (isfinite(prior_std_s) and prior_std_s > 0):
            raise ValueError(f"prior_std_s={prior_std_s}: must be > 0")
        self._theta[0] = a / _FEATURE_SCALE[0]
        self._theta[1] = b / _FEATURE_SCALE[1]
        self._theta[2] = c / _FEATURE_SCALE[2]
        cdef int i, j
        for i in range(3):
            for j in range(3):
                self._p[i][j] = prior_std_s * prior_std_s if i == j else 0.0
        self.forgetting = forgetting
        self._p_max = prior_std_s * prior_std_s
        self.observations = 0

    cdef double c_predict(self, double tokens, double context) noexcept nogil:
        cdef double t = (self._theta[0] * _FEATURE_SCALE[0] + self._theta[1] * _FEATURE_SCALE[1] * tokens
                         + self._theta[2] * _FEATURE_SCALE[2] * context)
        return t if t > 0.0 else 0.0

    cdef void c_observe(self, double tokens, double context, double seconds) noexcept nogil:
        cdef double x[3]
        cdef double px[3]
        cdef double denom, err
        cdef int i, j
        x[0] = 1.0
        x[1] = tokens * _FEATURE_SCALE[1]
        x[2] = context * _FEATURE_SCALE[2]
        for i in range(3):
            px[i] = self._p[i][0] * x[0] + self._p[i][1] * x[1] + self._p[i][2] * x[2]
        denom = self.forgetting + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        err = seconds - (self._theta[0] * x[0] + self._theta[1] * x[1] + self._theta[2] * x[2])
        for i in range(3):
            self._theta[i] += px[i] / denom * err
        for i in range(3):
            for j in range(3):
                self._p[i][j] = (self._p[i][j] - px[i] * px[j] / denom) / self.forgetting
        # Forgetting inflates P along directions the steps do not vary in (one
        # request decoding: tokens == 1 forever) until it overflows; cap each
        # variance at the prior's, scaling its row and column (P stays PSD).
        cdef double scale
        for i in range(3):
            if self._p[i][i] > self._p_max:
                scale = sqrt(self._p_max / self._p[i][i])
                for j in range(3):
                    self._p[i][j] *= scale
                    self._p[j][i] *= scale
        self.observations += 1

    def observe(self, double tokens, double context, double seconds):
        """One engine step: its scheduled tokens, its context and how long it took."""
        if not (isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds={seconds}: must be a finite number >= 0")
        if not (isfinite(tokens) and tokens >= 0 and isfinite(context) and context >= 0):
            raise ValueError(f"tokens={tokens}, context={context}: must be finite numbers >= 0")
        self.c_observe(tokens, context, seconds)

    def predict(self, double tokens, double context):
        return self.c_predict(tokens, context)

    @property
    def coefficients(self):
        """(a, b, c) in seconds, seconds per token, seconds per context token."""
        return (self._theta[0] * _FEATURE_SCALE[0], self._theta[1] * _FEATURE_SCALE[1],
                self._theta[2] * _FEATURE_SCALE[2])
