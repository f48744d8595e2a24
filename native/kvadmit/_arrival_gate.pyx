# The arrival gate: which arrivals the queue takes, and what a refused client is told.
#
# Caps (max_queued_requests, max_queued_tokens, max_queue_delay_s), priority
# shedding's refusals, and every Rejection the core gives: its reason, a message
# naming the limit and the numbers, and a Retry-After hint. The hint comes from
# the drain rate, the engine's recent pace at taking queued work: admissions
# counted against a backlog clock that runs only while requests wait (so a lightly
# loaded server's arrival rate is not mistaken for its pace); a refused burst is
# told to come back as a line, one admission apart, not all at once. The line is
# the set of retry times promised and not yet come (a place is forgotten when its
# time passes), and a request refused again before its own time gets its place
# back instead of a second one (see `_in_line` for how, without client identity).
#
# One clock: the core tells the gate its time (`c_note_time`, monotone: the core's
# own) before anything happens at that time, and tells it when its queue changes
# between empty and not (`c_queue_changed`); every refusal and hint is as of the
# last time told. How much waits, the core passes with the calls that need it.

from libc.stdint cimport int64_t, uint64_t
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.unordered_map cimport unordered_map
from cython.operator cimport dereference as deref

REJECT_REASONS = ("queue_full", "queued_tokens_full", "context_length", "kv_capacity", "shed",
                  "queue_delay", "slo_infeasible", "invalid", "expired")


cdef class Rejection:
    """Why a request was refused: a reason code, a message naming the limit,
    and a Retry-After hint in seconds (None when retrying cannot help)."""

    def __init__(self, reason, message, limit, limit_value, retry_after_s):
        self.reason = reason
        self.message = message
        self.limit = limit
        self.limit_value = limit_value
        self.retry_after_s = retry_after_s

    @property
    def retryable(self):
        """True for overload (try again later), False for a request this server can never take."""
        return self.retry_after_s is not None

    def __repr__(self):
        return f"Rejection({self.reason!r}, {self.message!r}, retry_after_s={self.retry_after_s})"


cdef class ArrivalResult:
    """Outcome of `AdmissionCore.arrive`: accepted with a slot, or rejected.

    ``shed`` lists (slot, Rejection) for waiting requests evicted to make room
    (priority shedding); the caller must finish them with that rejection."""

    def __init__(self, accepted, slot, rejection, shed):
        self.accepted = accepted
        self.slot = slot
        self.rejection = rejection
        self.shed = shed

    def __repr__(self):
        if self.accepted:
            return f"ArrivalResult(accepted, slot={self.slot}, shed={len(self.shed)})"
        return f"ArrivalResult(rejected, {self.rejection!r})"


cdef inline double _delay_at(int64_t ahead, int64_t ahead_tokens, int64_t queued,
                             double reqs_per_s, double tokens_per_s) noexcept nogil:
    """Seconds until `ahead` requests and their prefill, plus this one, drain."""
    cdef double wait = (ahead + 1) / reqs_per_s
    if tokens_per_s > 0:
        wait = max(wait, (ahead_tokens + queued) / tokens_per_s)
    return wait


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    """splitmix64's finaliser: a well-spread 64-bit hash of x."""
    x += <uint64_t>0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return x ^ (x >> 31)


# A client told to come back at `at` and arriving at `at` (its clock's rounding
# aside) is on time, not early: its place has passed.
cdef double _ON_TIME_S = 1e-9
# A new place looks for a gap among at most this many places after its own time;
# past them (a dense line) it goes after the last place, as a plain line would.
cdef size_t _GAP_SCAN = 64


cdef class ArrivalGate:
    """The arrival gate of one core (its settings from the config)."""

    def __init__(self, config):
        self.max_queued_requests = config.max_queued_requests
        self.max_queued_tokens = config.max_queued_tokens
        self.shed_lower_priority = config.shed_lower_priority
        self.max_queue_delay_s = config.max_queue_delay_s
        self.max_queue_age_s = config.max_queue_age_s
        self._retry_default = config.retry_after_default_s
        self._retry_max = config.retry_after_max_s
        self._drain_window = config.drain_window_s
        cdef int i
        for i in range(N_REJECT_REASONS):
            self._rejected[i] = 0
        self._claims = self._step = self._place = 0
        self._key = 0
        self._seen_time = self._backlog = False
        self._t_last = self._backlog_s = 0.0
        self._drain_tokens = 0

    # --- drain rate ------------------------------------------------------
    cdef void c_note_time(self, double now) noexcept nogil:
        """The core's time is `now` (it never goes back: an earlier `now` changes
        nothing). Advances the backlog clock: seconds during which requests were
        waiting. Admissions are counted against it, so the drain rate is the
        engine's pace at taking queued work, not the arrival rate of a lightly
        loaded server."""
        if self._seen_time and now > self._t_last:
            if self._backlog:
                self._backlog_s += now - self._t_last
            self._t_last = now
        elif not self._seen_time:
            self._t_last = now
            self._seen_time = True

    cdef void c_queue_changed(self, bint waiting) noexcept nogil:
        """The core's queue changed, at the time last noted: `waiting`, whether any
        request waits in it now (the backlog clock runs from here while it does)."""
        self._backlog = waiting

    cdef void c_admitted(self, int64_t prefill_tokens) noexcept nogil:
        """A waiting request with `prefill_tokens` to prefill was admitted."""
        self._drain.push_back(pair[double, int64_t](self._backlog_s, prefill_tokens))
        self._drain_tokens += prefill_tokens

    cdef void c_request(self, int64_t prompt_tokens, int64_t max_new_tokens, int64_t priority,
                        int64_t session, int64_t prompt_hash, int64_t step) noexcept nogil:
        """The request the next refusals are of, judged in engine step `step`: its
        signature for the retry line (what the core knows of a request, and what a
        retry of it repeats)."""
        self._step = step
        cdef uint64_t key = _mix(<uint64_t>prompt_tokens)
        key = _mix(key ^ <uint64_t>max_new_tokens)
        key = _mix(key ^ <uint64_t>priority)
        key = _mix(key ^ <uint64_t>session)
        self._key = _mix(key ^ <uint64_t>prompt_hash)

    cdef void c_admission_undone(self) noexcept nogil:
        """The latest admission (as a rule) was undone."""
        if not self._drain.empty():
            self._drain_tokens -= self._drain.back().second
            self._drain.pop_back()

    cdef bint _drain_rates(self, double* reqs_per_s, double* tokens_per_s) noexcept nogil:
        """Admissions and their prefill tokens per second of backlog over the last
        drain_window_s of backlog, as of the time last noted (False: none observed
        yet); forgets admissions older than the window."""
        cdef double horizon = self._backlog_s - self._drain_window
        while not self._drain.empty() and self._drain.front().first < horizon:
            self._drain_tokens -= self._drain.front().second
            self._drain.pop_front()
        return self._rates_as_of(self._t_last, reqs_per_s, tokens_per_s)

    cdef bint _rates_as_of(self, double now, double* reqs_per_s,
                           double* tokens_per_s) noexcept nogil:
        """The drain rates `_drain_rates` would give at `now`, changing nothing: a
        read (a router's scrape, a metrics export) must not move the backlog clock,
        or how often it is read would change later Retry-After hints and refusals."""
        cdef double backlog_s = self._backlog_s
        if self._seen_time and now > self._t_last and self._backlog:
            backlog_s += now - self._t_last
        cdef double horizon = backlog_s - self._drain_window
        cdef int64_t n = self._drain.size(), tokens = self._drain_tokens
        cdef size_t i = 0
        while i < self._drain.size() and self._drain[i].first < horizon:
            tokens -= self._drain[i].second
            n -= 1
            i += 1
        cdef double span = min(backlog_s, self._drain_window)
        if span <= 0.0 or n == 0:
            return False
        reqs_per_s[0] = n / span
        tokens_per_s[0] = tokens / span
        return True

    cdef bint _paced_rates(self, double* reqs_per_s, double* tokens_per_s) noexcept nogil:
        """The drain rates for Retry-After hints: measured over at least
        retry_after_default_s of backlog (a burst's first admissions, a few ms apart
        while the engine still had room, are not the pace it keeps once full)."""
        if not self._drain_rates(reqs_per_s, tokens_per_s):
            return False
        cdef double span = min(self._backlog_s, self._drain_window)
        if span < self._retry_default:
            reqs_per_s[0] *= span / self._retry_default
            tokens_per_s[0] *= span / self._retry_default
        return True

    cdef object _retry_after(self, double excess_reqs, double excess_tokens):
        """Seconds until the observed admission rate drains the excess (None: cannot drain)."""
        cdef double rr, rt
        if not self._paced_rates(&rr, &rt):
            return self._retry_default
        cdef double wait = 0.0
        if excess_reqs > 0:
            wait = excess_reqs / rr
        if excess_tokens > 0 and rt > 0:
            wait = max(wait, excess_tokens / rt)
        elif excess_tokens > 0:
            wait = max(wait, self._retry_default)
        return min(max(wait, 0.0), self._retry_max)

    cdef double c_predicted_delay(self, int64_t ahead, int64_t ahead_tokens,
                                  int64_t queued) noexcept nogil:
        """Queueing delay of an arrival behind `ahead` waiting requests (and their
        `ahead_tokens` of prefill), plus itself, at the recent admission rate
        (0 when nothing is ahead or no rate is known yet), as of the time last noted."""
        cdef double rr, rt
        if ahead == 0 or not self._drain_rates(&rr, &rt):
            return 0.0
        return _delay_at(ahead, ahead_tokens, queued, rr, rt)

    cdef double c_peek_predicted_delay(self, int64_t ahead, int64_t ahead_tokens, int64_t queued,
                                       double now) noexcept nogil:
        """`c_predicted_delay` as of `now` (the queue as it is), changing nothing (for reads)."""
        cdef double rr, rt
        if ahead == 0 or not self._rates_as_of(now, &rr, &rt):
            return 0.0
        return _delay_at(ahead, ahead_tokens, queued, rr, rt)

    # --- refusals --------------------------------------------------------
    cdef double _in_line(self, double wait) noexcept nogil:
        """Spreads a burst's Retry-After hints: a refused client is given a place in the
        retry line, a retry time no earlier than its own predicted wait (`now + wait`)
        and at least one admission (at the recent admission rate, `_paced_rates`;
        with none yet, retry_after_default_s / max_queued_requests) from every other
        place still to come, capped at now + retry_after_max_s. Deterministic.

        The line is the set of retry times promised and not yet come: a place is
        forgotten once its time passes, whether or not its client came back (the
        gate cannot know sooner that it will not). A line laid at a slower pace
        than the engine's pace now has room between its places, and a new place
        takes the first such gap (among the 64 places after its own time: past
        them, in a dense line, it goes after the last place, so a call costs at
        most a binary search, 64 steps and, for a request whose numbers are in the
        line, one pass over it).

        An early retry takes no second place. The core does not know who a client
        is, only a request's numbers, and a retry repeats them (a router resends the
        same body). So a refused request whose signature (prompt_tokens,
        max_new_tokens, priority, session; `c_request`) matches a place still to
        come is taken for that place's client back early, and is told that place
        again, if the place was handed out in an earlier engine step: a client
        cannot retry before the step that refused it has ended (its answer leaves
        the engine with that step's output), so equal requests refused in one step
        are distinct clients and get a place each, while a retry, on any router's
        or client's schedule (vllm-router: 50 ms, then x1.5; HAProxy: at once),
        comes in a later step. Among matching places, the one handed out longest
        ago: a burst retried on one backoff schedule gets its places back in order.
        The cost of a wrong guess (a new client with the numbers of a waiting one,
        in a later step) is a hint too short, never too long: that client comes
        back early, is refused again and gets its own place then; a hint too long,
        as every early retry inflated the line before, leaves room idle that
        nobody is told about. A matched place earlier than the client's own
        predicted wait now moves to that time (not behind the line: the client
        keeps its turn)."""
        cdef double rr, rt, spacing, now = self._t_last, at = now + wait
        cdef size_t i, n, lo, hi, best
        cdef int64_t best_claim = 0
        cdef size_t scanned = 0
        while not self._line.empty() and self._line.front().at <= now + _ON_TIME_S:
            self._forget_key(self._line.front().key)
            self._line.pop_front()
        n = self._line.size()
        best = n
        if self._line_keys.count(self._key):            # this request's place, back early?
            for i in range(n):
                if (self._line[i].key == self._key and self._line[i].step < self._step
                        and (best == n or self._line[i].claim < best_claim)):
                    best, best_claim = i, self._line[i].claim
        if best < n:
            if self._line[best].at >= at:
                self._line[best].claim = self._claims
                self._line[best].step = self._step
                self._claims += 1
                self._place = best + 1
                return self._line[best].at - now
            self._forget_key(self._key)
            self._line.erase(self._line.begin() + best)   # its room is later now: the place
            return self._insert_place(at, now) - now       # moves there, in its turn
        if not self._line.empty():
            if self._paced_rates(&rr, &rt) and rr > 0:
                spacing = 1.0 / rr
            else:
                spacing = self._retry_default / max(self.max_queued_requests, 1)
            lo, hi = 0, self._line.size()               # the first place after at - spacing
            while lo < hi:
                i = (lo + hi) // 2
                if self._line[i].at <= at - spacing:
                    lo = i + 1
                else:
                    hi = i
            while lo < self._line.size() and self._line[lo].at < at + spacing:
                at = self._line[lo].at + spacing           # too close to a place: after it
                lo += 1
                scanned += 1
                if scanned == _GAP_SCAN:                   # a dense line: after its last place
                    at = max(at, self._line.back().at + spacing)
                    break
        return self._insert_place(at, now) - now

    cdef double _insert_place(self, double at, double now) noexcept nogil:
        """Adds a place at `at`, at most now + retry_after_max_s, in time order (its
        index + 1 goes to `_place`); returns its time."""
        cdef Place p
        cdef size_t lo = 0, hi = self._line.size(), i
        at = min(at, now + self._retry_max)
        while lo < hi:                                  # after every place at or before it
            i = (lo + hi) // 2
            if self._line[i].at <= at:
                lo = i + 1
            else:
                hi = i
        p.at = at
        p.key = self._key
        p.claim = self._claims
        p.step = self._step
        self._claims += 1
        self._line.insert(self._line.begin() + lo, p)
        self._line_keys[self._key] += 1
        self._place = lo + 1
        return at

    cdef void _forget_key(self, uint64_t key) noexcept nogil:
        """One place of signature `key` leaves the line."""
        cdef unordered_map[uint64_t, int64_t].iterator it = self._line_keys.find(key)
        if it != self._line_keys.end():
            deref(it).second -= 1
            if deref(it).second == 0:
                self._line_keys.erase(it)

    cdef Rejection c_refuse(self, int code, str message, str limit, object value, object retry):
        """Counts a refusal; a retryable one gets its place in the retry line and its
        message the numbers a client needs (the message names the queue and the cap)."""
        cdef double wait
        self._rejected[code] += 1
        if retry is not None:
            wait = self._in_line(retry)
            message = (f"{message}; room expected in {retry:.3g} s, retry in {wait:.3g} s "
                       f"(place {self._place} in the retry line)")
            retry = wait
        return Rejection(REJECT_REASONS[code], message, limit, value, retry)

    cdef Rejection c_refuse_context(self, int64_t prompt_tokens, int64_t max_new_tokens,
                                    int64_t max_model_len):
        """The refusal of a request longer than the engine's context (None: it fits)."""
        cdef int64_t total = prompt_tokens + max_new_tokens
        if max_model_len > 0 and total > max_model_len:
            return self.c_refuse(
                R_CONTEXT,
                f"prompt_tokens ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds max_model_len={max_model_len}",
                "max_model_len", max_model_len, None)
        return None

    cdef Rejection c_refuse_prefill(self, int64_t queued):
        """The refusal of a prompt whose prefill alone exceeds max_queued_tokens (None: fits)."""
        if self.max_queued_tokens > 0 and queued > self.max_queued_tokens:
            return self.c_refuse(
                R_QUEUED_TOKENS,
                f"prompt needs {queued} tokens of prefill, more than max_queued_tokens="
                f"{self.max_queued_tokens}", "max_queued_tokens", self.max_queued_tokens, None)
        return None

    cdef Rejection c_refuse_delay(self, double delay, int64_t waiting, int64_t queued_tokens,
                                  double cap, str limit):
        """The refusal of an arrival whose predicted queueing delay exceeds `cap`
        (the config's max_queue_delay_s, or the request's own: `limit` names which;
        None: within it, or no cap)."""
        if cap > 0 and delay > cap:
            return self.c_refuse(
                R_QUEUE_DELAY,
                f"predicted queueing delay {delay:.3g} s ({waiting} requests and "
                f"{queued_tokens} prompt tokens waiting) exceeds {limit}={cap:g}",
                limit, cap, min(delay - cap, self._retry_max))
        return None

    cdef Rejection c_refuse_slo(self, double predicted, double target, int64_t waiting,
                                int64_t running):
        """The refusal of an arrival whose predicted TTFT exceeds its target (None: within)."""
        if predicted > target:
            return self.c_refuse(
                R_SLO,
                f"predicted TTFT {predicted:.3g} s ({waiting} requests waiting, "
                f"{running} running) exceeds its target ttft_slo_s="
                f"{target:g}", "ttft_slo_s", target,
                min(predicted - target, self._retry_max))
        return None

    cdef Rejection c_refuse_full(self, int64_t over_reqs, int64_t over_tokens, int64_t waiting,
                                 int64_t queued_tokens, int64_t queued):
        """The refusal of an arrival over a queue cap: `over_reqs` requests (if > 0),
        else `over_tokens` prefill tokens; `waiting` / `queued_tokens`: the queue now,
        `queued`: the arrival's prefill."""
        if over_reqs > 0:
            return self.c_refuse(
                R_QUEUE_FULL,
                f"queue full: {waiting} requests waiting, "
                f"max_queued_requests={self.max_queued_requests}",
                "max_queued_requests", self.max_queued_requests,
                self._retry_after(over_reqs, 0))
        return self.c_refuse(
            R_QUEUED_TOKENS,
            f"queue full: {queued_tokens} prompt tokens waiting + {queued} "
            f"exceeds max_queued_tokens={self.max_queued_tokens}",
            "max_queued_tokens", self.max_queued_tokens,
            self._retry_after(0, over_tokens))

    cdef Rejection c_refuse_flow_full(self, int64_t over_reqs, int64_t over_tokens,
                                      int64_t waiting, int64_t queued_tokens, int64_t queued,
                                      int64_t cap):
        """The refusal of an arrival over its flow's own cap `cap` (kvadmit._flows):
        `over_reqs` requests (if > 0), else `over_tokens` prefill tokens; `waiting` /
        `queued_tokens`: its flow's queue now, `queued`: the arrival's prefill. The
        core appends the flow's name."""
        if over_reqs > 0:
            return self.c_refuse(
                R_QUEUE_FULL, f"flow queue full: {waiting} of its requests waiting, its "
                f"max_queued_requests={cap}", "max_queued_requests", cap,
                self._retry_after(over_reqs, 0))
        return self.c_refuse(
            R_QUEUED_TOKENS, f"flow queue full: {queued_tokens} prompt tokens of its requests "
            f"waiting + {queued} exceeds its max_queued_tokens={cap}", "max_queued_tokens", cap,
            self._retry_after(0, over_tokens) if queued <= cap else None)

    cdef Rejection c_refuse_shed(self, int64_t priority, int64_t victim_priority,
                                 bint sheddable, bint over_reqs):
        """The refusal of a waiting request (`victim_priority`; `sheddable`: it is, the
        arrival is not) shed for an arrival of `priority` over the request cap
        (`over_reqs`) or the token cap."""
        return self.c_refuse(
            R_SHED,
            "shed from a full queue: sheddable, for a request that is not" if sheddable else
            f"shed from a full queue by a higher-priority request (priority {priority} "
            f"< {victim_priority})",
            "max_queued_requests" if over_reqs else "max_queued_tokens",
            self.max_queued_requests if over_reqs else self.max_queued_tokens,
            self._retry_default)

    cdef Rejection c_refuse_sheddable(self, bint queued):
        """The refusal of a sheddable request while the latest scan held one that is
        not (the pool is saturated: GIE's rule drops sheddable work then), at arrival
        or from the queue (`queued`). Retryable: the saturation passes."""
        return self.c_refuse(
            R_SHED, ("sheddable: dropped from the queue" if queued else "sheddable: refused")
            + " while requests that are not sheddable wait for KV", "sheddable", True,
            self._retry_default)

    cdef Rejection c_refuse_expired(self, double waited_s, double ttl_s, bint own_ttl):
        """The refusal of a waiting request that has not started within its TTL: stale
        work, dropped before any prefill (its own ``ttl_s``, or the config's
        max_queue_age_s). Not retryable: its client is presumed gone or late."""
        cdef str limit = "ttl_s" if own_ttl else "max_queue_age_s"
        return self.c_refuse(
            R_EXPIRED, f"waited {waited_s:.3g} s in the queue without starting, past its "
            f"{limit}={ttl_s:g} s: dropped before prefill", limit, ttl_s, None)

    @property
    def retry_max_s(self):
        return self._retry_max

    def rejected(self):
        """Refusals so far, by reason."""
        return {REJECT_REASONS[i]: self._rejected[i] for i in range(N_REJECT_REASONS)}
