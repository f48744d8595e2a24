# KV curves: the lockstep model behind the no-eviction policies.
#
# A running request that holds t tokens now and has r decode steps left holds
# t + k tokens at step k (k = 0 .. r-1) and frees everything after step r-1.
# The pool's demand at step k is the sum of ceil((t_i + k) / B) over requests
# with r_i > k. Between two finish times that sum only grows, so its maximum is
# reached at k = r_j - 1 for some j:
#
#     peak = max_j  sum_{i : r_i >= r_j} ceil((t_i + r_j - 1) / B)
#
# Computed exactly in O(n log B) after sorting by r (descending): write
# t = qB + s and k = aB + b, then ceil((t + k)/B) = q + a + [s + b > 0] + [s + b > B],
# so each term needs the sum of q, the count, the count of s == 0 and the count
# of s > B - b, kept in a Fenwick tree over residues s.

from libc.stdint cimport INT64_MAX, int32_t, int64_t
from libcpp.algorithm cimport sort
from libcpp.vector cimport vector

cdef inline void _fen_add(vector[int32_t]& fen, int64_t s, int32_t d) noexcept nogil:
    cdef int64_t i = s + 1
    cdef int64_t n = fen.size()
    while i < n:
        fen[i] += d
        i += i & (-i)

cdef inline int64_t _fen_prefix(vector[int32_t]& fen, int64_t s) noexcept nogil:
    """How many residues are <= s."""
    cdef int64_t i = s + 1
    cdef int64_t total = 0
    while i > 0:
        total += fen[i]
        i -= i & (-i)
    return total

cdef inline int64_t _demand_at(vector[int32_t]& fen, int64_t sum_q, int64_t cnt, int64_t cnt_s0,
                               int64_t k, int64_t B) noexcept nogil:
    """Blocks the requests in the tree (sum of q, count, count of s == 0) hold at
    step k, all of them still running."""
    cdef int64_t a = k // B, b = k % B
    cdef int64_t total = sum_q + cnt * a + cnt
    if b == 0:
        return total - cnt_s0
    return total + cnt - _fen_prefix(fen, B - b)


cdef int64_t _sweep(const Curve* curves, int64_t n, const Curve* extra, int64_t B,
                    int64_t limit, vector[int32_t]& fen, bint first_over) noexcept nogil:
    """The sweep both readings share: ``curves`` (sorted by steps, descending) and
    ``extra`` (may be NULL) enter the tree from the most steps left down; after each
    group of equal steps the demand is read at its last step, with every request
    entered so far still running.

    Not ``first_over``: the peak, the largest demand read, stopping as soon as it
    exceeds ``limit``. ``first_over``: the first step the demand exceeds ``limit``
    (-1: none): the requests entered run over steps [next group's steps, this
    group's last], their demand growing, so a stretch whose end is over is bisected;
    the earliest such stretch is read last.
    ``fen`` is scratch of size B + 1, all zero on entry and on return."""
    cdef int64_t i = 0, sum_q = 0, cnt = 0, cnt_s0 = 0, result = -1 if first_over else 0
    cdef int64_t total, s, next_steps, lo, hi, mid
    cdef bint extra_done = extra == NULL
    cdef bint extra_added = False
    cdef Curve cur
    while i < n or not extra_done:
        if not extra_done and (i >= n or extra.steps >= curves[i].steps):
            cur = extra[0]
            extra_done = True
            extra_added = True
        else:
            cur = curves[i]
            i += 1
        s = cur.tokens % B
        sum_q += cur.tokens // B
        cnt += 1
        if s == 0:
            cnt_s0 += 1
        _fen_add(fen, s, 1)
        # Evaluate once per distinct step count, after its whole group is in.
        if not extra_done and (i >= n or extra.steps >= curves[i].steps):
            next_steps = extra.steps
        elif i < n:
            next_steps = curves[i].steps
        else:
            next_steps = 0
        if next_steps == cur.steps:
            continue
        total = _demand_at(fen, sum_q, cnt, cnt_s0, cur.steps - 1, B)
        if first_over:
            if total > limit:
                lo, hi = next_steps, cur.steps - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    if _demand_at(fen, sum_q, cnt, cnt_s0, mid, B) > limit:
                        hi = mid
                    else:
                        lo = mid + 1
                result = lo
        elif total > result:
            result = total
            if result > limit:
                break
    # Restore the scratch tree.
    cdef int64_t j
    for j in range(i):
        _fen_add(fen, curves[j].tokens % B, -1)
    if extra_added:
        _fen_add(fen, extra.tokens % B, -1)
    return result


cdef int64_t peak_blocks_sorted(const Curve* curves, int64_t n, const Curve* extra,
                                int64_t B, int64_t limit, vector[int32_t]& fen) noexcept nogil:
    """Peak blocks of ``curves`` (sorted by steps, descending) plus ``extra`` (may be NULL).

    Stops as soon as the running maximum exceeds ``limit`` and returns it.
    ``fen`` is scratch of size B + 1, all zero on entry and on return.
    """
    return _sweep(curves, n, extra, B, limit, fen, False)


cdef int64_t first_over_sorted(const Curve* curves, int64_t n, const Curve* extra, int64_t B,
                               int64_t limit, vector[int32_t]& fen) noexcept nogil:
    """The first step at which ``curves`` (sorted as for `peak_blocks_sorted`) plus
    ``extra`` hold more than ``limit`` blocks, or -1 if they never do (`_sweep`)."""
    return _sweep(curves, n, extra, B, limit, fen, True)


def first_over(tokens, steps, int64_t block_size, int64_t limit):
    """The first step (0: the next) at which requests holding ``tokens[i]`` now with
    ``steps[i]`` steps left hold more than ``limit`` blocks, or -1 (see
    `first_over_sorted`)."""
    cdef vector[Curve] v = _curves(tokens, steps, block_size)
    cdef vector[int32_t] fen
    fen.assign(block_size + 1, 0)
    return first_over_sorted(v.data(), v.size(), NULL, block_size, limit, fen)


cdef vector[Curve] _curves(tokens, steps, int64_t block_size) except *:
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    if len(tokens) != len(steps):
        raise ValueError(f"tokens has {len(tokens)} entries, steps has {len(steps)}")
    cdef vector[Curve] v
    cdef Curve c
    for t, r in zip(tokens, steps):
        if t < 0:
            raise ValueError(f"tokens={t}: must be >= 0")
        if r < 1:
            raise ValueError(f"steps={r}: must be >= 1")
        c.tokens = t
        c.steps = r
        v.push_back(c)
    sort(v.begin(), v.end(), curve_longer)
    return v


def peak_blocks(tokens, steps, int64_t block_size):
    """Peak KV blocks of requests holding ``tokens[i]`` now with ``steps[i]`` steps left.

    The pure function behind ``peak`` and ``adaptive`` (see the model above).
    """
    cdef vector[Curve] v = _curves(tokens, steps, block_size)
    cdef vector[int32_t] fen
    fen.assign(block_size + 1, 0)
    return peak_blocks_sorted(v.data(), v.size(), NULL, block_size, INT64_MAX, fen)
