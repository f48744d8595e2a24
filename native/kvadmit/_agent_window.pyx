# The active-agent window (CONCUR): how many agent sessions may hold KV at once.
#
# A session becomes active when one of its requests is admitted; while W
# sessions are active, requests of inactive sessions wait (they never block the
# queue). Every agent_interval_steps W follows AIMD on KV usage and prefix hit
# rate; sessions idle for agent_idle_s leave, and when W shrinks the most
# recently activated sessions between generations are paused. Paused and expired
# sessions are logged so an engine can demote their cached prefixes.
#
# The core tells the window when a request of a session is queued, leaves the
# queue, starts, stops and is admitted; the window knows nothing of slots.

from cython.operator cimport dereference as deref, preincrement as inc
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector


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


cdef class AgentWindow:
    """The active-agent window of one core (``config.agent_window``; disabled, every
    call is a no-op and nothing is held). ``num_blocks``: the KV pool, for usage."""

    def __init__(self, config, int64_t num_blocks):
        self.enabled = config.agent_window
        self._num_blocks = num_blocks
        self._size = config.agent_window_init
        self._size_min = config.agent_window_min
        self._size_max = config.agent_window_max
        self._alpha = config.agent_alpha
        self._beta = config.agent_beta
        self._usage_low = config.agent_usage_low
        self._usage_high = config.agent_usage_high
        self._hit_threshold = config.agent_hit_threshold
        self._interval_steps_cfg = config.agent_interval_steps
        self._cooldown_intervals = config.agent_cooldown_intervals
        self._idle_s = config.agent_idle_s
        self._cooldown_left = self._n_active = self._activations = self._changes = 0
        self._interval_steps = self._interval_hit_tokens = self._interval_query_tokens = 0
        self._interval_usage_sum = 0.0

    # --- what the core reports about a session's requests ----------------
    cdef void c_track(self, int64_t session, double now) noexcept nogil:
        """A request of `session` arrives: a new session is known from now (idle)."""
        if self.enabled and session >= 0 and self._sessions.count(session) == 0:
            self._sessions[session] = AgentSession(0, 0, 0, now, -1)

    cdef void c_queued(self, int64_t session) noexcept nogil:
        if self.enabled and session >= 0:
            self._sessions[session].waiting += 1

    cdef void c_unqueued(self, int64_t session, double now) noexcept nogil:
        cdef AgentSession* a
        if self.enabled and session >= 0:
            a = &self._sessions[session]
            a.waiting -= 1
            self._leaves(a, now)

    cdef void c_started(self, int64_t session) noexcept nogil:
        if self.enabled and session >= 0:
            self._sessions[session].running += 1

    cdef void c_stopped(self, int64_t session, double now) noexcept nogil:
        cdef AgentSession* a
        if self.enabled and session >= 0:
            a = &self._sessions[session]
            a.running -= 1
            self._leaves(a, now)

    cdef void _leaves(self, AgentSession* a, double now) noexcept nogil:
        """A session left with nothing queued or running is idle from now."""
        if a.waiting == 0 and a.running == 0:
            a.idle_since = now

    cdef bint c_activate(self, int64_t session) noexcept nogil:
        """A request of `session` is admitted: the session becomes active. True if
        this admission activated it (so undoing it deactivates the session)."""
        cdef AgentSession* a
        if not self.enabled or session < 0:
            return False
        a = &self._sessions[session]
        if a.active:
            return False
        a.active = 1
        a.activated = self._activations
        self._activations += 1
        self._n_active += 1
        return True

    cdef void c_undo_activation(self, int64_t session) noexcept nogil:
        """The admission that activated `session` is undone (nothing of it runs)."""
        cdef AgentSession* a = &self._sessions[session]
        if a.active and a.running == 0:
            a.active = 0
            self._n_active -= 1

    # --- the window --------------------------------------------------------
    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                              double now) noexcept nogil:
        """One engine step's KV usage and prefix hits; every agent_interval_steps W
        follows AIMD. A window over W pauses sessions, a full one expires idle ones."""
        self._interval_usage_sum += used_blocks / <double>self._num_blocks
        self._interval_hit_tokens += hit_tokens
        self._interval_query_tokens += query_tokens
        self._interval_steps += 1
        if self._interval_steps >= self._interval_steps_cfg:
            self._update(self._interval_usage_sum / self._interval_steps,
                         self._interval_hit_tokens / <double>self._interval_query_tokens if self._interval_query_tokens > 0 else 1.0,
                         now)
            self._interval_steps = self._interval_hit_tokens = self._interval_query_tokens = 0
            self._interval_usage_sum = 0.0
        if self._n_active > <int64_t>self._size:
            self._pause_excess()
        elif self._n_active >= <int64_t>self._size:
            self.c_expire_idle(now)    # a full window: an idle session must not hold a place

    cdef void _update(self, double usage, double hit_rate, double now) noexcept nogil:
        cdef double w = c_next_agent_window(self._size, usage, hit_rate, self._alpha, self._beta,
                                            self._usage_low, self._usage_high, self._hit_threshold,
                                            self._size_min, self._size_max)
        if w > self._size and self._cooldown_left > 0:
            w = self._size              # hysteresis: no regrowth right after a cut
        if w < self._size:
            self._cooldown_left = self._cooldown_intervals
        elif self._cooldown_left > 0:
            self._cooldown_left -= 1
        if w != self._size:
            self._changes += 1
        self._size = w
        if <int64_t>self._history.size() >= 2 * HISTORY_KEPT:
            # a server runs for months: keep the recent updates, not every one
            self._history.erase(self._history.begin(), self._history.begin() + HISTORY_KEPT)
        self._history.push_back(w)
        self.c_expire_idle(now)

    cdef void c_expire_idle(self, double now) noexcept nogil:
        """Sessions with nothing queued or running for agent_idle_s as of `now` leave
        the window (and the table)."""
        cdef unordered_map[int64_t, AgentSession].iterator it = self._sessions.begin()
        while it != self._sessions.end():
            # (a relative tolerance: `c_next_expiry` + idle_s must expire exactly)
            if (deref(it).second.waiting == 0 and deref(it).second.running == 0
                    and now - deref(it).second.idle_since
                    >= self._idle_s * (1.0 - 1e-12) - 1e-12):
                if deref(it).second.active:
                    self._n_active -= 1
                    self._paused_log.push_back(deref(it).first)
                it = self._sessions.erase(it)
            else:
                inc(it)

    cdef double c_next_expiry(self) noexcept nogil:
        """When the first active idle session will leave the window (INFINITY: none)."""
        cdef double t = INFINITY
        cdef unordered_map[int64_t, AgentSession].iterator it = self._sessions.begin()
        while it != self._sessions.end():
            if (deref(it).second.active and deref(it).second.waiting == 0
                    and deref(it).second.running == 0
                    and deref(it).second.idle_since + self._idle_s < t):
                t = deref(it).second.idle_since + self._idle_s
            inc(it)
        return t

    cdef void _pause_excess(self) noexcept nogil:
        """Pauses the most recently activated sessions between generations (none
        of their requests running) until at most W are active."""
        cdef unordered_map[int64_t, AgentSession].iterator it
        cdef AgentSession* pick
        cdef int64_t picked
        while self._n_active > <int64_t>self._size:
            pick = NULL
            it = self._sessions.begin()
            while it != self._sessions.end():
                if deref(it).second.active and deref(it).second.running == 0 and (
                        pick == NULL or deref(it).second.activated > pick.activated):
                    pick = &deref(it).second
                    picked = deref(it).first
                inc(it)
            if pick == NULL:
                return               # the rest are mid-generation: paused when they finish
            pick.active = 0
            self._n_active -= 1
            self._paused_log.push_back(picked)

    cdef bint c_is_active(self, int64_t session) noexcept nogil:
        """Inside the window (always, without agent_window or a session)."""
        if not self.enabled or session < 0:
            return True
        cdef unordered_map[int64_t, AgentSession].iterator it = self._sessions.find(session)
        return it != self._sessions.end() and deref(it).second.active

    cdef void c_take_paused(self, vector[int64_t]& out) noexcept nogil:
        """Appends the sessions paused or expired since the last take to `out`."""
        out.insert(out.end(), self._paused_log.begin(), self._paused_log.end())
        self._paused_log.clear()

    # --- Python API ------------------------------------------------------
    def take_paused_sessions(self):
        cdef list out = [x for x in self._paused_log]
        self._paused_log.clear()
        return out

    def history(self):
        """W after each of the last HISTORY_KEPT (at least) AIMD updates, oldest first."""
        return [w for w in self._history]

    def stats(self):
        return {"size": self._size, "active_sessions": self._n_active,
                "sessions": self._sessions.size(), "changes": self._changes}
