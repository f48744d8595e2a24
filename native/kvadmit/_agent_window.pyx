# The active-agent window (CONCUR): how many agent sessions may hold KV at once.
# The AIMD rule is pure and exact so the core (and the tests) can drive it with
# injected numbers.

cdef double c_next_agent_window(double window, double usage, double hit_rate, double alpha,
                                double beta, double u_low, double u_high, double h_thresh,
                                double w_min, double w_max) noexcept nogil:
    if usage < u_low:
        window = window + alpha
    elif usage > u_high and hit_rate < h_thresh:
        window = window * beta
    if window < w_min:
        window = w_min
    if window > w_max:
        window = w_max
    return window


def next_agent_window(double window, double usage, double hit_rate, double alpha=2.0,
                      double beta=0.5, double u_low=0.2, double u_high=0.5, double h_thresh=0.2,
                      double w_min=1.0, double w_max=1e9):
    """CONCUR's AIMD rule: grow the active-agent window by ``alpha`` while KV usage
    is below ``u_low``; multiply it by ``beta`` when usage is above ``u_high`` and
    the prefix hit rate is below ``h_thresh`` (thrashing); otherwise hold."""
    return c_next_agent_window(window, usage, hit_rate, alpha, beta, u_low, u_high, h_thresh,
                               w_min, w_max)
