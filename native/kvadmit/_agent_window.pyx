# The active-agent window (CONCUR): how many agent sessions may hold KV at once.
#
# A session becomes active when one of its requests is admitted; while W
# sessions are active, requests of inactive sessions wait (they never block the
# queue). Every agent_interval_s of engine time W follows AIMD on KV usage and
# prefix hit rate; between updates a session is not held while the latest step
# left the pool nearly empty (usage below agent_usage_low: CONCUR's own growth
# signal, taken at once): it enters and W grows by one. Time, not steps: an engine
# with nothing to run steps at whatever rate its loop spins. Sessions idle for
# agent_idle_s leave; when W shrinks the most recently activated sessions between
# generations are paused. No session is held longer than agent_max_wait_s, nor
# longer than half its own TTFT target (an interactive session is never starved): it
# enters over a full window and W grows by one (rotating another out would only
# trade places, and caches, while demand stays above W). While a session is held, an idle one keeps its
# place at most IDLE_GAPS mean return gaps (the tool waits seen), not agent_idle_s:
# idle that long it has most likely finished (nothing says so: a session has no
# last request). Paused and expired sessions are logged so an engine can demote
# their cached prefixes.
#
# The core tells the window when a request of a session is queued, leaves the
# queue, starts, stops and is admitted, and the time; it knows nothing of slots.

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
        self._interval_s = config.agent_interval_s
        self._cooldown_intervals = config.agent_cooldown_intervals
        self._idle_s = config.agent_idle_s
        self._max_wait_s = config.agent_max_wait_s
        self._interval_start, self._now = -INFINITY, -INFINITY
        self._usage = 1.0               # unknown until the first step: no growth on demand
        self._gap_mean, self._gaps = 0.0, 0
        self._cooldown_left = self._n_active = self._activations = self._changes = 0
        self._paused = self._expired = self._overdue = self._interactive = 0
        self._interval_steps = self._interval_hit_tokens = self._interval_query_tokens = 0
        self._interval_usage_sum = 0.0

    # --- what the core reports about a session's requests ----------------
    cdef void c_track(self, int64_t session, double now, double ttft_target) noexcept nogil:
        """A request of `session` arrives: a new session is known from now (idle);
        `ttft_target` > 0: the request's own TTFT target, which bounds how long the
        session is held (the tightest such target of its requests)."""
        if not self.enabled or session < 0:
            return
        cdef AgentSession* a
        cdef double gap
        if self._sessions.count(session) == 0:
            self._sessions[session] = AgentSession(0, 0, 0, now, now, -1, INFINITY, 0, now)
        else:
            a = &self._sessions[session]
            if a.waiting == 0 and a.running == 0 and a.activated >= 0:
                # a session back from its tool: its gap teaches how long one stays idle
                gap = now - a.idle_since
                self._gaps += 1
                self._gap_mean += (gap - self._gap_mean) / (self._gaps if self._gaps < GAP_MEMORY
                                                            else GAP_MEMORY)
        a = &self._sessions[session]
        if ttft_target > 0 and ttft_target < a.ttft_target:
            if a.ttft_target == INFINITY:
                self._interactive += 1
            a.ttft_target = ttft_target

    cdef void c_queued(self, int64_t session, double now) noexcept nogil:
        cdef AgentSession* a
        if self.enabled and session >= 0:
            a = &self._sessions[session]
            if a.waiting == 0:
                a.waiting_since = now
            a.waiting += 1

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
        a.entered_over, a.held_from = 0, a.waiting_since
        if self._n_active >= <int64_t>self._size and (self._overdue_at(a, self._now)
                                                      or self._room_now()):
            # over a full window: an overdue session, or room in a nearly empty pool. W
            # grows to take it (up to agent_window_max; past it, overdue sessions take
            # turns between generations): rotating another out for it would only trade
            # places, and caches, while demand stays above W
            if self._overdue_at(a, self._now):
                a.entered_over = 1
                self._overdue += 1
            if self._n_active + 1 <= self._size_max:
                a.entered_over |= 2
                self._size = self._n_active + 1
                self._changes += 1
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
            # an engine may undo the same admission step after step: count it once,
            # and the session's wait goes on from where it was (its request re-queued)
            a.waiting_since = a.held_from
            self._overdue -= a.entered_over & 1
            if a.entered_over & 2:
                self._size -= 1
                self._changes -= 1
            a.entered_over = 0

    # --- the window --------------------------------------------------------
    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                              double now) noexcept nogil:
        """One engine step's KV usage and prefix hits; every agent_interval_s W follows
        AIMD. A window over W pauses sessions, a full one expires idle ones."""
        self.c_note_time(now)
        self._usage = used_blocks / <double>self._num_blocks
        self._interval_usage_sum += self._usage
        self._interval_hit_tokens += hit_tokens
        self._interval_query_tokens += query_tokens
        self._interval_steps += 1
        if self._interval_start == -INFINITY:
            self._interval_start = now
        if now >= self._interval_start + self._interval_s:   # as c_next_change computes it
            self._end_interval(now)
        if self._n_active > <int64_t>self._size:
            self._pause_excess()
        elif self._n_active >= <int64_t>self._size:
            self.c_expire_idle(now)    # a full window: an idle session must not hold a place

    cdef void c_on_time(self, double now) noexcept nogil:
        """The engine had nothing to run until `now` (its pool is empty): idle sessions
        leave, and W follows a due update (no steps in it: no usage, no queries)."""
        if not self.enabled:
            return
        self.c_note_time(now)
        self._usage = 0.0
        if self._interval_start > -INFINITY and now >= self._interval_start + self._interval_s \
                and self._any_held():
            self._end_interval(now)
        self.c_expire_idle(now)

    cdef void _end_interval(self, double now) noexcept nogil:
        cdef double usage = self._interval_usage_sum / self._interval_steps \
            if self._interval_steps > 0 else 0.0
        cdef double hits = self._interval_hit_tokens / <double>self._interval_query_tokens \
            if self._interval_query_tokens > 0 else 1.0
        self._update(usage, hits, now)
        self._interval_start = now
        self._interval_steps = self._interval_hit_tokens = self._interval_query_tokens = 0
        self._interval_usage_sum = 0.0

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

    cdef double _idle_bound(self) noexcept nogil:
        """How long an idle session keeps its place: agent_idle_s; while another is held
        outside, at most IDLE_GAPS mean return gaps (once GAP_MEMORY / 8 are seen):
        idle that long it has most likely finished, and its place is wanted. (The scan
        for a held session comes last: this runs every step while the window is full.)"""
        if self._gaps >= GAP_MEMORY // 8 and IDLE_GAPS * self._gap_mean < self._idle_s \
                and self._any_held():
            return IDLE_GAPS * self._gap_mean
        return self._idle_s

    cdef void c_expire_idle(self, double now) noexcept nogil:
        """Sessions with nothing queued or running for `_idle_bound` as of `now` leave
        the window (and the table)."""
        cdef double bound = self._idle_bound()
        cdef unordered_map[int64_t, AgentSession].iterator it = self._sessions.begin()
        while it != self._sessions.end():
            # (a relative tolerance: `c_next_change`'s idle_since + bound must expire exactly)
            if (deref(it).second.waiting == 0 and deref(it).second.running == 0
                    and now - deref(it).second.idle_since
                    >= bound * (1.0 - 1e-12) - 1e-12):
                if deref(it).second.active:
                    self._n_active -= 1
                    self._expired += 1
                    self._paused_log.push_back(deref(it).first)
                it = self._sessions.erase(it)
            else:
                inc(it)

    cdef double c_next_change(self) noexcept nogil:
        """When the window next changes on its own, with nothing run (INFINITY: never):
        an active idle session leaves; while a session is held, it becomes overdue
        (agent_max_wait_s) or W follows its next update."""
        cdef double t = INFINITY
        cdef bint held = self._any_held()
        cdef double bound = self._idle_bound()
        cdef AgentSession* a
        cdef unordered_map[int64_t, AgentSession].iterator it = self._sessions.begin()
        while it != self._sessions.end():
            a = &deref(it).second
            if a.active and a.waiting == 0 and a.running == 0 and a.idle_since + bound < t:
                t = a.idle_since + bound
            if not a.active and a.waiting > 0:
                if a.waiting_since + self._wait_bound(a) < t:
                    t = a.waiting_since + self._wait_bound(a)
            inc(it)
        if held and self._interval_s > 0 and self._interval_start > -INFINITY \
                and self._interval_start + self._interval_s < t:
            t = self._interval_start + self._interval_s   # (interval 0: steps update W)
        return t

    cdef bint _any_held(self) noexcept nogil:
        cdef unordered_map[int64_t, AgentSession].iterator it = self._sessions.begin()
        while it != self._sessions.end():
            if not deref(it).second.active and deref(it).second.waiting > 0:
                return True
            inc(it)
        return False

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
            self._paused += 1
            pick.waiting_since = self._now     # held from now, not since it queued
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
        """W, sessions, and counts: sessions taken out of the window (`exits`: paused
        when W shrank, expired idle), admissions over a full window after their wait
        bound (`overdue`)."""
        return {"size": self._size, "active_sessions": self._n_active,
                "sessions": self._sessions.size(), "changes": self._changes,
                "exits": {"paused": self._paused, "expired": self._expired},
                "overdue": self._overdue, "interactive_sessions": self._interactive,
                "return_gap_mean_s": self._gap_mean, "return_gaps": self._gaps}
