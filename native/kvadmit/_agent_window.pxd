# The agent window's C-level API (see _agent_window.pyx). Sessions are the
# engine's session ids (-1: a request of no session; every call ignores it).
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector


cdef enum:
    HISTORY_KEPT = 4096     # AIMD updates history() keeps (between this and twice it)
    GAP_MEMORY = 64         # return gaps the mean follows (a running mean, then this window)
    IDLE_GAPS = 4           # mean gaps idle: finished (P(exponential gap > 4 means) = 1.8%)


cdef struct AgentSession:
    char active
    int32_t waiting        # requests queued (never started or preempted)
    int32_t running
    double idle_since      # when it last had nothing queued or running
    double waiting_since   # when its queued requests began to wait (waiting > 0)
    int64_t activated      # activation order (LIFO pause)
    double ttft_target     # the tightest own TTFT target of its requests (INFINITY: none)
    char entered_over      # its activation came over a full window: 1 overdue, 2 W grew
    double held_from       # waiting_since at its activation (an undone one restores it)


cdef double c_next_agent_window(double window, double usage, double hit_rate, double alpha,
                                double beta, double u_low, double u_high, double h_thresh,
                                double w_min, double w_max) noexcept nogil


cdef class AgentWindow:
    cdef readonly bint enabled
    cdef int64_t _num_blocks
    cdef unordered_map[int64_t, AgentSession] _sessions
    cdef double _size, _size_min, _size_max, _alpha, _beta
    cdef double _usage_low, _usage_high, _hit_threshold, _idle_s, _max_wait_s
    cdef double _interval_s, _interval_start, _now
    cdef double _usage                     # KV usage at the latest step
    cdef double _gap_mean                  # sessions' mean return gap (tool wait), seconds
    cdef int64_t _gaps                     # return gaps seen
    cdef int64_t _cooldown_intervals, _cooldown_left
    cdef int64_t _n_active, _activations, _changes
    cdef int64_t _paused, _expired, _overdue, _interactive
    cdef int64_t _interval_steps, _interval_hit_tokens, _interval_query_tokens
    cdef double _interval_usage_sum
    cdef vector[double] _history
    cdef vector[int64_t] _paused_log       # sessions paused or expired, for the engine's cache

    cdef inline void c_note_time(self, double now) noexcept nogil:
        if now > self._now:
            self._now = now

    cdef inline bint c_holds(self, int64_t session) noexcept nogil:
        """A request of this session waits outside the window: its session is not
        active, the window is full, it has waited less than its bound (agent_max_wait_s,
        or its own TTFT target if sooner), and the pool is not nearly empty."""
        if not self.enabled or session < 0:
            return False
        cdef AgentSession* a = &self._sessions[session]
        return not a.active and self._n_active >= <int64_t>self._size \
            and not self._overdue_at(a, self._now) and not self._room_now()

    cdef inline bint _room_now(self) noexcept nogil:
        """The pool is nearly empty (usage below agent_usage_low) and W may grow: a
        session held now would only leave it idle until the next update."""
        return self._usage < self._usage_low and self._n_active < <int64_t>self._size_max

    cdef inline bint _overdue_at(self, const AgentSession* a, double now) noexcept nogil:
        return a.waiting > 0 and now >= a.waiting_since + self._wait_bound(a)

    cdef inline double _wait_bound(self, const AgentSession* a) noexcept nogil:
        """How long the window may hold this session: agent_max_wait_s (0: no bound),
        or half its own TTFT target if sooner (an interactive session is never
        starved; the other half is for its queue and prefill)."""
        cdef double bound = self._max_wait_s if self._max_wait_s > 0 else INFINITY
        return 0.5 * a.ttft_target if 0.5 * a.ttft_target < bound else bound

    cdef inline double c_size(self) noexcept nogil:
        """The current W: how many sessions may be active."""
        return self._size

    cdef inline int64_t c_active(self) noexcept nogil:
        return self._n_active

    cdef void c_track(self, int64_t session, double now, double ttft_target) noexcept nogil
    cdef void c_queued(self, int64_t session, double now) noexcept nogil
    cdef void c_unqueued(self, int64_t session, double now) noexcept nogil
    cdef void c_started(self, int64_t session) noexcept nogil
    cdef void c_stopped(self, int64_t session, double now) noexcept nogil
    cdef bint c_activate(self, int64_t session) noexcept nogil
    cdef void c_undo_activation(self, int64_t session) noexcept nogil
    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                              double now) noexcept nogil
    cdef void c_expire_idle(self, double now) noexcept nogil
    cdef void c_on_time(self, double now) noexcept nogil
    cdef double c_next_change(self) noexcept nogil
    cdef bint c_is_active(self, int64_t session) noexcept nogil
    cdef void c_take_paused(self, vector[int64_t]& out) noexcept nogil
    cdef void _leaves(self, AgentSession* a, double now) noexcept nogil
    cdef void _update(self, double usage, double hit_rate, double now) noexcept nogil
    cdef void _end_interval(self, double now) noexcept nogil
    cdef void _pause_excess(self) noexcept nogil
    cdef double _idle_bound(self) noexcept nogil
    cdef bint _any_held(self) noexcept nogil
