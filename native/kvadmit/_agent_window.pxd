# The agent window's C-level API (see _agent_window.pyx). Sessions are the
# engine's session ids (-1: a request of no session; every call ignores it).
from libc.stdint cimport int32_t, int64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector


cdef enum:
    HISTORY_KEPT = 4096     # AIMD updates history() keeps (between this and twice it)


cdef struct AgentSession:
    char active
    int32_t waiting        # requests queued (never started or preempted)
    int32_t running
    double idle_since      # when it last had nothing queued or running
    int64_t activated      # activation order (LIFO pause)


cdef double c_next_agent_window(double window, double usage, double hit_rate, double alpha,
                                double beta, double u_low, double u_high, double h_thresh,
                                double w_min, double w_max) noexcept nogil


cdef class AgentWindow:
    cdef readonly bint enabled
    cdef int64_t _num_blocks
    cdef unordered_map[int64_t, AgentSession] _sessions
    cdef double _size, _size_min, _size_max, _alpha, _beta
    cdef double _usage_low, _usage_high, _hit_threshold, _idle_s
    cdef int64_t _interval_steps_cfg, _cooldown_intervals, _cooldown_left
    cdef int64_t _n_active, _activations, _changes
    cdef int64_t _interval_steps, _interval_hit_tokens, _interval_query_tokens
    cdef double _interval_usage_sum
    cdef vector[double] _history
    cdef vector[int64_t] _paused_log       # sessions paused or expired, for the engine's cache

    cdef inline bint c_holds(self, int64_t session) noexcept nogil:
        """A request of this session waits outside the window: its session is not
        active and the window is full."""
        if not self.enabled or session < 0:
            return False
        return not self._sessions[session].active and self._n_active >= <int64_t>self._size

    cdef inline double c_size(self) noexcept nogil:
        """The current W: how many sessions may be active."""
        return self._size

    cdef inline int64_t c_active(self) noexcept nogil:
        return self._n_active

    cdef void c_track(self, int64_t session, double now) noexcept nogil
    cdef void c_queued(self, int64_t session) noexcept nogil
    cdef void c_unqueued(self, int64_t session, double now) noexcept nogil
    cdef void c_started(self, int64_t session) noexcept nogil
    cdef void c_stopped(self, int64_t session, double now) noexcept nogil
    cdef bint c_activate(self, int64_t session) noexcept nogil
    cdef void c_undo_activation(self, int64_t session) noexcept nogil
    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                              double now) noexcept nogil
    cdef void c_expire_idle(self, double now) noexcept nogil
    cdef double c_next_expiry(self) noexcept nogil
    cdef bint c_is_active(self, int64_t session) noexcept nogil
    cdef void c_take_paused(self, vector[int64_t]& out) noexcept nogil
    cdef void _leaves(self, AgentSession* a, double now) noexcept nogil
    cdef void _update(self, double usage, double hit_rate, double now) noexcept nogil
    cdef void _pause_excess(self) noexcept nogil
