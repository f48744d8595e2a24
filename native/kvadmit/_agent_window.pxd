# The agent window's C-level API (see _agent_window.pyx).

cdef double c_next_agent_window(double window, double usage, double hit_rate, double alpha,
                                double beta, double u_low, double u_high, double h_thresh,
                                double w_min, double w_max) noexcept nogil
