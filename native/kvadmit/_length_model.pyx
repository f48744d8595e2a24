# Online model of output lengths, for the `adaptive` policy.
#
# Model: the output lengths of the last `window` finished requests, kept as
# counts in buckets of `bucket_tokens` (bucket j holds lengths in
# (j*w, (j+1)*w]) in a Fenwick tree, so both the update and the query are
# O(log buckets). For a request that has generated g tokens, the prediction is
# the q-quantile of the length L among finished requests with L > g (lengths
# conditioned on having survived g tokens), rounded up to its bucket's upper
# edge, minus g, and capped by the request's own max_new - g. With fewer than
# `min_samples` lengths, or when no finished request ran longer than g, it
# predicts the worst case, max_new - g.
#
# Lanes: lane 0 holds every length observed in it; a caller may keep other lanes
# (the auto policy: one per flow, whose requests end alike), each its own window of
# `lane_window` lengths (at most `window`), its storage taken at its first length.

from libc.math cimport ceil
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._curves cimport cdiv

cdef inline void _check_lane(int32_t lane) except *:
    if lane < 0:
        raise ValueError(f"lane={lane}: must be >= 0")


cdef class OutputLengthModel:
    """Quantiles of recent output lengths, conditioned on tokens generated so far."""

    def __cinit__(self, int64_t bucket_tokens=16, int64_t max_tokens=131072,
                  int64_t window=4096, int64_t min_samples=32, int64_t lane_window=0):
        if bucket_tokens < 1:
            raise ValueError(f"bucket_tokens={bucket_tokens}: must be >= 1")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1")
        if min_samples < 1:
            raise ValueError(f"min_samples={min_samples}: must be >= 1")
        if lane_window < 0:
            raise ValueError(f"lane_window={lane_window}: must be >= 0 (0: window)")
        self._bucket = bucket_tokens
        self._nbuckets = cdiv(max_tokens, bucket_tokens)
        self._window = window
        self._lane_window = window if lane_window == 0 or lane_window > window else lane_window
        self._min_samples = min_samples
        self._open(0)

    cdef void _open(self, int32_t lane) noexcept nogil:
        """Lane `lane` gets its storage (and every lane below it a place)."""
        if <size_t>lane >= self._fenwick.size():
            self._fenwick.resize(lane + 1)
            self._ring.resize(lane + 1)
            self._ring_pos.resize(lane + 1, 0)
            self._count.resize(lane + 1, 0)
        if self._fenwick[lane].size() == 0:
            self._fenwick[lane].assign(self._nbuckets + 1, 0)
            self._ring[lane].assign(self._window if lane == 0 else self._lane_window, -1)

    cdef inline int64_t _bucket_of(self, int64_t length) noexcept nogil:
        cdef int64_t j = (length - 1) // self._bucket
        if j < 0:
            return 0
        if j >= self._nbuckets:
            return self._nbuckets - 1
        return j

    cdef inline void _add(self, int32_t lane, int64_t j, int32_t d) noexcept nogil:
        cdef int64_t i = j + 1
        cdef vector[int32_t]* tree = &self._fenwick[lane]
        while i <= self._nbuckets:
            tree[0][i] += d
            i += i & (-i)

    cdef inline int64_t _count_upto(self, int32_t lane, int64_t j) noexcept nogil:
        """Samples of the lane in buckets 0..j."""
        cdef int64_t i = j + 1
        cdef int64_t total = 0
        cdef vector[int32_t]* tree = &self._fenwick[lane]
        if i > self._nbuckets:
            i = self._nbuckets
        while i > 0:
            total += tree[0][i]
            i -= i & (-i)
        return total

    cdef inline int64_t _first_bucket_reaching(self, int32_t lane, int64_t target) noexcept nogil:
        """Smallest bucket j with count(0..j) >= target in the lane (Fenwick descent)."""
        cdef int64_t pos = 0, step = 1, acc = 0
        cdef vector[int32_t]* tree = &self._fenwick[lane]
        while step * 2 <= self._nbuckets:
            step *= 2
        while step > 0:
            if pos + step <= self._nbuckets and acc + tree[0][pos + step] < target:
                pos += step
                acc += tree[0][pos]
            step //= 2
        return pos  # 0-based bucket index

    cdef void c_observe(self, int64_t length, int32_t lane=0) noexcept nogil:
        self._open(lane)
        cdef int64_t old = self._ring[lane][self._ring_pos[lane]]
        if old >= 0:
            self._add(lane, old, -1)
            self._count[lane] -= 1
        cdef int64_t j = self._bucket_of(length)
        self._ring[lane][self._ring_pos[lane]] = <int32_t>j
        self._add(lane, j, 1)
        self._count[lane] += 1
        self._ring_pos[lane] = (self._ring_pos[lane] + 1) % <int64_t>self._ring[lane].size()

    cdef int64_t c_samples(self, int32_t lane=0) noexcept nogil:
        """Lengths the lane holds now (0 for a lane never observed)."""
        return self._count[lane] if <size_t>lane < self._count.size() else 0

    cdef int64_t c_predict_remaining(self, int64_t generated, int64_t max_new,
                                     double quantile, int32_t lane=0) noexcept nogil:
        cdef int64_t worst = max_new - generated
        if worst < 1:
            worst = 1
        cdef int64_t count = self.c_samples(lane)
        if count < self._min_samples:
            return worst
        # Buckets entirely at or below `generated` hold requests that had already
        # finished by now: they are not this request's peers.
        cdef int64_t below = 0
        if generated >= self._bucket:
            below = self._count_upto(lane, generated // self._bucket - 1)
        cdef int64_t survivors = count - below
        if survivors <= 0:
            return worst
        cdef int64_t need = <int64_t>ceil(quantile * survivors)
        if need < 1:
            need = 1
        cdef int64_t j = self._first_bucket_reaching(lane, below + need)
        cdef int64_t remaining = (j + 1) * self._bucket - generated
        if remaining < 1:
            remaining = 1
        return remaining if remaining < worst else worst

    cdef double c_survival(self, int64_t generated, int32_t lane=0) noexcept nogil:
        """Share of the lane's lengths above `generated` (bucket resolution, as the
        prediction conditions); -1 with fewer than min_samples lengths."""
        cdef int64_t count = self.c_samples(lane)
        if count < self._min_samples:
            return -1.0
        cdef int64_t below = 0
        if generated >= self._bucket:
            below = self._count_upto(lane, generated // self._bucket - 1)
        return (count - below) / <double>count

    @property
    def num_samples(self):
        return self._count[0]

    def lane_samples(self, int32_t lane):
        """Lengths lane `lane` holds now (0 for a lane never observed)."""
        _check_lane(lane)
        return self.c_samples(lane)

    def observe(self, int64_t length, int32_t lane=0):
        """Records a finished request's output length (tokens), in lane `lane`."""
        if length < 0:
            raise ValueError(f"length={length}: must be >= 0")
        _check_lane(lane)
        self.c_observe(length, lane)

    def predict_remaining(self, int64_t generated, int64_t max_new, double quantile,
                          int32_t lane=0):
        """Predicted tokens still to come for a request that generated ``generated``,
        from lane `lane`'s lengths."""
        if generated < 0:
            raise ValueError(f"generated={generated}: must be >= 0")
        if max_new < 1:
            raise ValueError(f"max_new={max_new}: must be >= 1")
        if not (0.0 < quantile <= 1.0):
            raise ValueError(f"quantile={quantile}: must be in (0, 1]")
        _check_lane(lane)
        return self.c_predict_remaining(generated, max_new, quantile, lane)


def next_quantile(double q, double base, double q_max, int64_t preemptions,
                  int64_t admissions, double target_rate):
    """The adaptive policy's quantile for the next window (pure function).

    Over a window of ``admissions``: more preemptions than ``target_rate`` per
    admission moves q halfway to ``q_max``; a window without preemptions
    relaxes it a quarter of the way back to ``base``; otherwise q stays.
    """
    return c_next_quantile(q, base, q_max, preemptions, admissions, target_rate)
