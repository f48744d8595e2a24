# The admission core: request ledger, admission policies, caps, victims.
#
# Engine-agnostic and clock-free: the caller passes `now` (seconds) and the
# engine's current free blocks; everything else is in native arrays indexed by
# a request slot. Query, then commit: `next_admissible` / `decide` only look,
# `admit` / `preempt` / `finish` change state.

cdef enum:
    ST_FREE = 0
    ST_WAITING = 1
    ST_RUNNING = 2

STATES = ("free", "waiting", "running")
POLICIES = ("overcommit", "reserve", "peak", "predict", "adaptive", "auto")
VICTIMS = ("lifo", "priority", "lcf", "length")
DECISIONS = ("admit", "hold_blocks", "hold_capacity", "hold_slo", "hold_agent", "hold_paused")

cdef enum:  # indexes into POLICIES
    P_OVERCOMMIT = 0
    P_RESERVE = 1
    P_PEAK = 2
    P_PREDICT = 3
    P_ADAPTIVE = 4
    P_AUTO = 5        # adaptive's curves, own constants (AUTO_*), prefix sharing discounted

cdef enum:  # indexes into VICTIMS
    V_LIFO = 0
    V_PRIORITY = 1
    V_LCF = 2
    V_LENGTH = 3

cdef enum:  # indexes into DECISIONS
    D_ADMIT = 0
    D_HOLD_BLOCKS = 1
    D_HOLD_CAPACITY = 2
    D_HOLD_SLO = 3        # the TPOT guard: the step would be too slow for a running request
    D_HOLD_AGENT = 4      # its session is outside the active-agent window
    D_HOLD_PAUSED = 5     # running requests are paused this step (shortfall: pause)
    N_DECISIONS = 6

# `auto`: the zero-config default. Its length quantile and controller settings are
# fixed here (not the adaptive_* keys): one setting for every workload.
cdef double AUTO_QUANTILE = 0.4          # starting (and lowest) quantile of the output-length model
cdef double AUTO_MAX_QUANTILE = 0.95     # ceiling the controller may raise it to
cdef double AUTO_TARGET_PREEMPTION_RATE = 0.01   # preemptions per admission that raise it
cdef enum:
    AUTO_MIN_SAMPLES = 1     # finished lengths before predictions replace max_tokens
    AUTO_INTERVAL = 64       # admissions per controller window
    AUTO_MAX_BYPASS = 1000   # head_of_line auto: times a held request may be passed
    AUTO_LOOKAHEAD = 256     # head_of_line auto: requests examined behind a held head

cdef extern from *:
    """
    // The waiting queue's key, smallest served first: (order key, the engine's arrival
    // time, its tie-break, arrival seq). The engine's arrival time and tie-break order
    // requests of equal priority under queue_order "priority" (vLLM: arrival_time, then
    // request id); elsewhere they are 0 and the arrival seq decides.
    struct kvadmit_QKey {
        int64_t first; double time; double tie; int64_t second;
        bool operator<(const kvadmit_QKey& o) const {
            if (first != o.first) return first < o.first;
            if (time != o.time) return time < o.time;
            if (tie != o.tie) return tie < o.tie;
            return second < o.second;
        }
    };
    """
    cdef cppclass QKey "kvadmit_QKey":
        int64_t first
        double time
        double tie
        int64_t second
        bint operator<(const QKey&)


cdef struct VictimKey:
    int64_t k1
    int64_t k2
    int64_t k3
    int32_t slot

cdef bint victim_key_less(const VictimKey& a, const VictimKey& b) noexcept nogil:
    """Orders running requests from most protected to first victim."""
    if a.k1 != b.k1:
        return a.k1 < b.k1
    if a.k2 != b.k2:
        return a.k2 < b.k2
    if a.k3 != b.k3:
        return a.k3 < b.k3
    return a.slot < b.slot


cdef vector[int64_t] _counts(str name, values) except *:
    """A sequence of counts (>= 0) as a native vector; a negative one names its index."""
    cdef vector[int64_t] v
    for i, x in enumerate(values):
        if x < 0:
            raise ValueError(f"{name}[{i}]={x}: must be >= 0")
        v.push_back(x)
    return v


cdef class AdmissionCore:
    """Decides which waiting request takes KV memory, which waits, which is
    refused and which running request gives memory back.

    ``config`` is a `kvadmit.AdmissionConfig`; ``num_blocks`` and
    ``block_size`` describe the engine's KV pool, ``max_model_len`` its
    context limit (0: no limit).
    """
    # engine shape
    cdef readonly int64_t num_blocks
    cdef readonly int64_t block_size
    cdef readonly int64_t max_model_len
    cdef readonly object config
    # settings
    cdef int _policy, _victim
    cdef bint _priority_order, _bypass
    cdef int64_t _max_bypass, _lookahead, _prefill_chunk
    cdef double _predict_init_ratio, _predict_min_ratio, _predict_ratio_decay
    cdef int64_t _predict_clip_tokens, _predict_retract_steps
    cdef double _quantile_base, _quantile_max, _target_preemption_rate
    cdef int64_t _adapt_interval
    # ledger, indexed by slot
    cdef vector[int64_t] _prompt, _cached, _computed, _generated, _max_new
    cdef vector[int64_t] _priority, _arrival, _admit_seq, _admit_step, _blocks, _pred_total
    cdef vector[int32_t] _bypassed, _preempts, _run_pos
    cdef vector[char] _state, _sheddable
    cdef vector[int32_t] _free_slots
    # queues
    cdef cmap[QKey, int32_t] _waiting
    cdef cmap[QKey, int32_t] _shed_order   # never-admitted waiting, by (priority, arrival)
    cdef vector[int32_t] _running
    # aggregates and caches
    cdef int64_t _queued_tokens, _reserve_sum, _seq, _step
    cdef int64_t _run_ctx          # sum of _tokens over running requests (the SLO guard's context)
    cdef vector[Curve] _profile
    cdef bint _profile_dirty
    cdef double _offsets_sum
    cdef bint _offsets_dirty
    cdef vector[int32_t] _fenwick
    # predict / adaptive state
    cdef double _ratio
    cdef bint _preempted_this_step
    cdef bint _pause_on_shortfall
    cdef int64_t _paused_now, _n_pauses   # running requests paused this step; request-steps in all
    cdef OutputLengthModel _lengths
    cdef double _quantile
    cdef deque[char] _capped_window   # auto: whether each recent finish ran to its max_tokens
    cdef int64_t _n_capped            # auto: how many in _capped_window did
    cdef vector[int64_t] _shared      # auto: prompt tokens a running request shares with others (prefix hits)
    cdef int64_t _unowned_blocks      # auto: blocks in use that no running request's own part counts
    cdef int64_t _max_shared_blocks   # auto: the longest prefix a running request shares, in blocks
    cdef int64_t _adapt_admits, _adapt_preempts
    cdef readonly ArrivalGate gate      # caps, refusals, drain rate and Retry-After
    # counters
    cdef int64_t _n_arrived, _n_admitted, _n_preempted, _n_finished, _n_aborted
    cdef int64_t _held[N_DECISIONS]           # (request, step) pairs held at the queue head
    cdef vector[int64_t] _held_step           # per slot: the step its last hold was counted in
    # SLO guard
    cdef readonly SloGuard slo_guard     # TPOT hold, TTFT prediction, the step-time fit
    cdef bint _deadline_order
    cdef vector[double] _ttft, _tpot, _arrive_t
    cdef vector[double] _engine_t, _engine_tie   # the engine's arrival time and tie-break
    # agent window
    cdef readonly AgentWindow agent_window   # sessions, W, idle expiry, the pause log
    cdef vector[int64_t] _session        # per slot: its session (-1: none)
    cdef vector[char] _activated_by     # this slot's admission activated its session
    cdef double _last_now
    cdef int64_t _n_len_obs
    cdef double _len_abs_err, _len_pred_sum, _len_actual_sum

    def __init__(self, config, int64_t num_blocks, int64_t block_size, int64_t max_model_len=0):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        if block_size < 1 or block_size > 1 << 20:
            raise ValueError(f"block_size={block_size}: must be in [1, 1048576]")
        if max_model_len < 0:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 0 (0: no limit)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.config = config
        self._policy = POLICIES.index(config.policy)
        self._victim = VICTIMS.index(config.victim)
        self._priority_order = config.queue_order == "priority"
        self._bypass = config.bypass_head_of_line
        self._pause_on_shortfall = config.pause_on_shortfall
        self._max_bypass = config.max_bypass
        self._lookahead = config.bypass_lookahead
        if config.head_of_line == "auto" and self._bypass:
            self._max_bypass, self._lookahead = AUTO_MAX_BYPASS, AUTO_LOOKAHEAD
        self.gate = ArrivalGate(config)
        self._prefill_chunk = config.prefill_chunk_tokens
        self._predict_init_ratio = config.predict_init_ratio
        self._predict_min_ratio = config.predict_init_ratio * config.predict_min_ratio_factor
        self._predict_ratio_decay = (self._predict_init_ratio - self._predict_min_ratio) / config.predict_decay_steps
        self._predict_clip_tokens = config.predict_clip_tokens
        self._predict_retract_steps = config.predict_retract_steps
        self._quantile_base = config.adaptive_quantile
        self._quantile_max = config.adaptive_max_quantile
        self._target_preemption_rate = config.adaptive_target_preemption_rate
        self._adapt_interval = config.adaptive_interval
        self.slo_guard = SloGuard(config)
        self._deadline_order = config.queue_order == "deadline"
        self.agent_window = AgentWindow(config, num_blocks)
        self._last_now = 0.0
        if self._policy == P_AUTO:
            self._quantile_base, self._quantile_max = AUTO_QUANTILE, AUTO_MAX_QUANTILE
            self._target_preemption_rate, self._adapt_interval = AUTO_TARGET_PREEMPTION_RATE, AUTO_INTERVAL
        self._unowned_blocks = self._max_shared_blocks = 0
        self._n_capped = 0
        self._lengths = OutputLengthModel(
            config.adaptive_bucket_tokens,
            max_model_len if max_model_len > 0 else num_blocks * block_size,
            config.adaptive_window,
            AUTO_MIN_SAMPLES if self._policy == P_AUTO else config.adaptive_min_samples)
        self._quantile = self._quantile_base
        self._ratio = self._predict_init_ratio
        self._fenwick.assign(block_size + 1, 0)
        self._profile_dirty = True
        self._offsets_dirty = True
        self._queued_tokens = self._reserve_sum = self._seq = self._step = self._run_ctx = 0
        self._n_arrived = self._n_admitted = self._n_preempted = 0
        self._n_finished = self._n_aborted = self._n_len_obs = 0
        self._adapt_admits = self._adapt_preempts = 0
        self._preempted_this_step = False
        self._paused_now = self._n_pauses = 0
        cdef int i
        for i in range(N_DECISIONS):
            self._held[i] = 0
        self._len_abs_err = self._len_pred_sum = self._len_actual_sum = 0.0

    # ------------------------------------------------------------------
    # Per-request numbers
    cdef inline int64_t _tokens(self, int32_t s) noexcept nogil:
        """KV tokens a request needs to run its next step: prompt plus output so far."""
        return self._prompt[s] + self._generated[s]

    cdef inline int64_t _worst_steps(self, int32_t s) noexcept nogil:
        cdef int64_t r = self._max_new[s] - self._generated[s]
        return r if r > 1 else 1

    cdef inline int64_t _prefill_extra_steps(self, int32_t s) noexcept nogil:
        """Steps a chunked prefill adds before decoding starts (0 when unchunked)."""
        if self._prefill_chunk <= 0:
            return 0
        cdef int64_t todo = self._tokens(s) - self._computed[s]
        if todo <= self._prefill_chunk:
            return 0
        return cdiv(todo, self._prefill_chunk) - 1

    cdef inline Curve _curve(self, int32_t s) noexcept nogil:
        cdef Curve c
        c.tokens = self._tokens(s)
        if self._policy == P_AUTO:
            c.tokens -= self._shared[s]      # counted once, in _unowned_blocks
        if self._policy == P_ADAPTIVE or self._policy == P_AUTO:
            c.steps = self._predict_remaining(s)
        else:
            c.steps = self._worst_steps(s)
        c.steps += self._prefill_extra_steps(s)
        return c

    cdef inline int64_t _predict_remaining(self, int32_t s) noexcept nogil:
        """Output tokens still to come, as adaptive and auto predict them. auto also
        learns how often requests run to their max_tokens (honest caps): a request
        stops at its cap with probability h, else at a length from the model of the
        requests that stopped earlier; the q-quantile of that mixture is the cap when
        h >= 1 - q, else the model's q / (1 - h) quantile. So honest caps give peak's
        exact curves, and caps far above the lengths give the length model's."""
        cdef double h, survive, q = self._quantile
        if self._policy == P_AUTO and self._capped_window.size() > 0:
            h = self._n_capped / <double>self._capped_window.size()
            if h > 0.0:
                # Still running after g tokens: it runs to its cap with probability
                # h / (h + (1 - h) S(g)), S(g) the share of early stoppers longer than g.
                survive = self._lengths.c_survival(self._generated[s])
                h = h / (h + (1.0 - h) * survive) if survive >= 0.0 else 1.0
            if h >= 1.0 - q:
                return self._worst_steps(s)
            q = q / (1.0 - h)
        return self._lengths.c_predict_remaining(self._generated[s], self._max_new[s], q)

    cdef inline int64_t _reserve_blocks(self, int32_t s) noexcept nogil:
        return cdiv(self._prompt[s] + self._max_new[s], self.block_size)

    cdef inline int64_t _queued_of(self, int32_t s) noexcept nogil:
        """Tokens a waiting request still has to prefill."""
        cdef int64_t q = self._tokens(s) - self._cached[s]
        return q if q > 0 else 0

    cdef inline double _predict_offset(self, int32_t s) noexcept nogil:
        cdef int64_t rem = self._max_new[s] - self._generated[s]
        if rem < 0:
            rem = 0
        if rem > self._predict_clip_tokens:
            rem = self._predict_clip_tokens
        # Admitted this step: charged in full, as SGLang's PrefillAdder does.
        return <double>rem if self._admit_step[s] == self._step else rem * self._ratio

    # ------------------------------------------------------------------
    # Running-set caches
    cdef void _ensure_profile(self) noexcept nogil:
        if not self._profile_dirty:
            return
        self._profile.clear()
        cdef size_t i
        for i in range(self._running.size()):
            self._profile.push_back(self._curve(self._running[i]))
        sort(self._profile.begin(), self._profile.end(), curve_longer)
        self._profile_dirty = False

    cdef void _profile_insert(self, int32_t s) noexcept nogil:
        if self._profile_dirty:
            return
        cdef Curve c = self._curve(s)
        cdef vector[Curve].iterator it = self._profile.begin()
        while it != self._profile.end() and deref(it).steps >= c.steps:
            inc(it)
        self._profile.insert(it, c)

    cdef double _offsets(self) noexcept nogil:
        cdef size_t i
        if self._offsets_dirty:
            self._offsets_sum = 0.0
            for i in range(self._running.size()):
                self._offsets_sum += self._predict_offset(self._running[i])
            self._offsets_dirty = False
        return self._offsets_sum

    cdef inline void _dirty(self) noexcept nogil:
        self._profile_dirty = True
        self._offsets_dirty = True

    # ------------------------------------------------------------------
    # The decision
    cdef bint _fits_capacity(self, int32_t s, bint alone) noexcept nogil:
        """The policy's future-capacity rule for candidate s. With ``alone``
        (nothing running) it asks whether s could ever run on this pool."""
        cdef Curve c
        if self._policy == P_RESERVE:
            return (0 if alone else self._reserve_sum) + self._reserve_blocks(s) <= self.num_blocks
        if alone:
            if self._policy == P_PREDICT and self._queued_of(s) + min(
                    self._max_new[s], self._predict_clip_tokens) >= self.num_blocks * self.block_size:
                return False  # its own rule would hold it even on an empty pool
            # Every other policy runs s once it fits alone: its worst-case curve must.
            c.tokens = self._tokens(s)
            c.steps = self._worst_steps(s) + self._prefill_extra_steps(s)
            return peak_blocks_sorted(NULL, 0, &c, self.block_size, self.num_blocks,
                                      self._fenwick) <= self.num_blocks
        # peak / adaptive / auto (_decide settles overcommit and predict itself)
        self._ensure_profile()
        c = self._curve(s)
        return peak_blocks_sorted(self._profile.data(), self._profile.size(), &c,
                                  self.block_size, self.num_blocks, self._fenwick) \
            + self._shared_term() <= self.num_blocks

    cdef inline double _running_context(self) noexcept nogil:
        return <double>self._run_ctx

    cdef bint _tpot_ok(self, int32_t s) noexcept nogil:
        return self.slo_guard.c_tpot_ok(self._tpot[s], self._running.size(),
                                        self._running_context() + self._tokens(s))

    cdef inline bint _agent_held(self, int32_t s) noexcept nogil:
        return self.agent_window.c_holds(self._session[s])

    cdef int _decide(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil:
        if self._agent_held(s):
            return D_HOLD_AGENT
        cdef int d = self._decide_memory(s, free_blocks, check_blocks)
        if d == D_ADMIT and not self._tpot_ok(s):
            return D_HOLD_SLO
        return d

    cdef int _decide_memory(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil:
        cdef int64_t need_now = cdiv(self._tokens(s), self.block_size) - self._cached[s] // self.block_size
        if check_blocks and need_now > free_blocks:
            return D_HOLD_BLOCKS
        if self._policy == P_PREDICT:
            # SGLang: admit while prompt + clipped max_new < free tokens - running offsets.
            if <double>(self._queued_of(s) + min(self._max_new[s] - self._generated[s], self._predict_clip_tokens)) \
                    >= free_blocks * self.block_size - self._offsets():
                return D_HOLD_CAPACITY
            return D_ADMIT
        if self._policy == P_OVERCOMMIT:
            return D_ADMIT
        if not self._fits_capacity(s, False):
            return D_HOLD_CAPACITY
        return D_ADMIT

    # ------------------------------------------------------------------
    # Slots
    cdef int32_t _new_slot(self):
        cdef int32_t s
        if not self._free_slots.empty():
            s = self._free_slots.back()
            self._free_slots.pop_back()
            return s
        s = <int32_t>self._prompt.size()
        self._prompt.push_back(0); self._cached.push_back(0); self._computed.push_back(0)
        self._generated.push_back(0); self._max_new.push_back(0); self._priority.push_back(0)
        self._arrival.push_back(0); self._admit_seq.push_back(-1); self._admit_step.push_back(-1)
        self._held_step.push_back(-1)
        self._blocks.push_back(0); self._pred_total.push_back(0); self._shared.push_back(0)
        self._bypassed.push_back(0); self._preempts.push_back(0); self._run_pos.push_back(-1)
        self._state.push_back(ST_FREE); self._sheddable.push_back(0)
        self._ttft.push_back(0.0); self._tpot.push_back(0.0); self._arrive_t.push_back(0.0)
        self._engine_t.push_back(0.0); self._engine_tie.push_back(0.0)
        self._session.push_back(-1); self._activated_by.push_back(0)
        return s

    cdef int _check_live(self, int64_t s) except -1:
        """A slot that holds a request (waiting or running)."""
        if s < 0 or s >= <int64_t>self._state.size() or self._state[s] == ST_FREE:
            raise KeyError(f"slot {s} is not a live request")
        return 0

    cdef int _check_slot(self, int64_t s, int want) except -1:
        """A live slot in state `want` (ST_WAITING or ST_RUNNING)."""
        self._check_live(s)
        if self._state[s] != want:
            raise ValueError(
                f"slot {s} is {STATES[<int>self._state[s]]}, "
                f"expected {STATES[want]}")
        return 0

    cdef inline QKey _qkey(self, int32_t s) noexcept nogil:
        cdef QKey k
        k.first = self._priority[s] if self._priority_order else 0
        if self._deadline_order:   # microseconds; no target: an hour after arrival
            k.first = <int64_t>((self._arrive_t[s] + (self._ttft[s] if self._ttft[s] > 0 else 3600.0)) * 1e6)
        k.time = self._engine_t[s] if self._priority_order else 0.0
        k.tie = self._engine_tie[s] if self._priority_order else 0.0
        k.second = self._arrival[s]
        return k

    cdef inline QKey _shed_key(self, int32_t s) noexcept nogil:
        cdef QKey k
        k.first = self._priority[s]
        k.time = self._engine_t[s] if self._priority_order else 0.0
        k.tie = self._engine_tie[s] if self._priority_order else 0.0
        k.second = self._arrival[s]
        return k

    cdef void _enqueue(self, int32_t s) noexcept nogil:
        self._state[s] = ST_WAITING
        self._waiting[self._qkey(s)] = s
        self._queued_tokens += self._queued_of(s)
        self.agent_window.c_queued(self._session[s])

    cdef void _dequeue(self, int32_t s) noexcept nogil:
        self._waiting.erase(self._qkey(s))
        self._queued_tokens -= self._queued_of(s)
        self.agent_window.c_unqueued(self._session[s], self._last_now)
        if self._sheddable[s]:
            self._shed_order.erase(self._shed_key(s))
            self._sheddable[s] = 0

    cdef void _run_add(self, int32_t s) noexcept nogil:
        self._state[s] = ST_RUNNING
        self._run_pos[s] = <int32_t>self._running.size()
        self._running.push_back(s)
        self._reserve_sum += self._reserve_blocks(s)
        self._run_ctx += self._tokens(s)
        self.slo_guard.c_started(self._tpot[s])
        self.agent_window.c_started(self._session[s])

    cdef void _run_remove(self, int32_t s) noexcept nogil:
        cdef int32_t pos = self._run_pos[s]
        cdef int32_t last = self._running.back()
        self._running[pos] = last
        self._run_pos[last] = pos
        self._running.pop_back()
        self._run_pos[s] = -1
        self._reserve_sum -= self._reserve_blocks(s)
        self._run_ctx -= self._tokens(s)
        self._dirty()
        self.slo_guard.c_stopped(self._tpot[s])
        self.agent_window.c_stopped(self._session[s], self._last_now)

    cdef void _release(self, int32_t s) noexcept nogil:
        self._state[s] = ST_FREE
        self._free_slots.push_back(s)

    # ------------------------------------------------------------------
    # Drain rate and Retry-After
    cdef inline void _note_time(self, double now) noexcept nogil:
        """The arrival gate's backlog clock (it runs while anything waits)."""
        self.gate.c_note_time(now, not self._waiting.empty())

    cdef inline double _predicted_delay(self, int64_t ahead, int64_t ahead_tokens, int64_t queued,
                                        double now) noexcept nogil:
        return self.gate.c_predicted_delay(ahead, ahead_tokens, queued, now, not self._waiting.empty())

    cdef void _ahead_of(self, int32_t s, int64_t* reqs, int64_t* tokens) noexcept nogil:
        """Waiting requests (and their prefill tokens) that the queue order serves
        before s: all of them in arrival order, else a walk to s's position
        (skipping requests held outside the agent window: they do not block s)."""
        if not self._priority_order and not self._deadline_order and not self.agent_window.enabled:
            reqs[0] = self._waiting.size()
            tokens[0] = self._queued_tokens
            return
        cdef QKey key = self._qkey(s)
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        reqs[0] = tokens[0] = 0
        while it != self._waiting.end() and deref(it).first < key:
            if not self._agent_held(deref(it).second):   # held ones do not block it
                reqs[0] += 1
                tokens[0] += self._queued_of(deref(it).second)
            inc(it)

    def refuse_invalid(self, str message, str limit=None):
        """Counts the refusal of a malformed request (reason 'invalid', never
        retryable) and returns it: one an engine adapter found before `arrive`
        (its fields, its token ids), or that `arrive` raised ValueError for.
        Not counted as an arrival: it never reached the queue."""
        return self.gate.c_refuse(R_INVALID, message, limit, None, None, not self._waiting.empty())

    def refuse_oversized_group(self, int64_t samples):
        """Counts and returns the refusal of a parallel-sampling request whose
        `samples` sequences could never be queued together (more than
        max_queued_requests): queue_full, never retryable. An arrival, as the
        request's other refusals are (None when it fits the cap)."""
        cdef int64_t cap = self.gate.max_queued_requests
        if cap <= 0 or samples <= cap:
            return None
        self._n_arrived += 1
        return self.gate.c_refuse(
            R_QUEUE_FULL, f"the request's n={samples} samples exceed max_queued_requests="
            f"{cap}: they can never be queued together",
            "max_queued_requests", cap, None, not self._waiting.empty())

    # ------------------------------------------------------------------
    # Public API: arrivals
    def arrive(self, int64_t prompt_tokens, int64_t max_new_tokens, int64_t priority=0,
               int64_t cached_tokens=0, double now=0.0, double ttft_slo_s=-1.0,
               double tpot_slo_s=-1.0, int64_t session=-1, double arrival_time=0.0,
               double arrival_tie=0.0):
        """A request arrives: queue it (slot) or refuse it (Rejection).

        ``ttft_slo_s`` / ``tpot_slo_s``: its targets (negative: the config's
        defaults; 0: none). ``session``: its agent/session id (-1: none).
        ``arrival_time`` / ``arrival_tie``: the engine's own arrival timestamp (any
        clock) and tie-break; under queue_order "priority" requests of equal priority
        are served by them, then in the order they arrived here.
        Bad numbers raise ValueError naming the field; limits of this server
        (context, KV pool, queue caps, SLO feasibility) give a Rejection."""
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={prompt_tokens}: must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        if cached_tokens < 0 or cached_tokens > prompt_tokens:
            raise ValueError(f"cached_tokens={cached_tokens}: must be in [0, prompt_tokens={prompt_tokens}]")
        if not isfinite(now):
            raise ValueError(f"now={now}: must be a finite number of seconds")
        if not isfinite(ttft_slo_s) or not isfinite(tpot_slo_s):
            raise ValueError(f"ttft_slo_s={ttft_slo_s}, tpot_slo_s={tpot_slo_s}: must be finite")
        if not isfinite(arrival_time) or not isfinite(arrival_tie):
            raise ValueError(f"arrival_time={arrival_time}, arrival_tie={arrival_tie}: must be finite")
        self._note_time(now)
        self._advance(now)
        self._n_arrived += 1
        cdef Rejection refused = self.gate.c_refuse_context(prompt_tokens, max_new_tokens,
                                                            self.max_model_len, not self._waiting.empty())
        if refused is not None:
            return ArrivalResult(False, -1, refused, [])
        cdef int32_t s = self._new_request(prompt_tokens, max_new_tokens, priority, cached_tokens, now,
                                           ttft_slo_s, tpot_slo_s, session, arrival_time, arrival_tie)
        cdef list shed = []
        refused = self._refusal(s, now)
        if refused is None:
            refused = self._make_room(s, now, shed)
        if refused is not None:
            self._release(s)
            return ArrivalResult(False, -1, refused, [])
        self._enqueue(s)
        self._sheddable[s] = 1
        self._shed_order[self._shed_key(s)] = s
        return ArrivalResult(True, s, None, shed)

    cdef int32_t _new_request(self, int64_t prompt_tokens, int64_t max_new_tokens, int64_t priority,
                              int64_t cached_tokens, double now, double ttft_slo_s, double tpot_slo_s,
                              int64_t session, double arrival_time, double arrival_tie):
        """A slot holding an arrival's numbers, not yet queued (its state is waiting
        so the policies may read it)."""
        cdef int32_t s = self._new_slot()
        self._prompt[s] = prompt_tokens
        self._cached[s] = cached_tokens
        self._computed[s] = 0
        self._generated[s] = 0
        self._max_new[s] = max_new_tokens
        self._priority[s] = priority
        self._arrival[s] = self._seq
        self._seq += 1
        self._admit_seq[s] = -1
        self._admit_step[s] = -1
        self._held_step[s] = -1
        self._blocks[s] = 0
        self._shared[s] = 0
        self._bypassed[s] = 0
        self._preempts[s] = 0
        self._pred_total[s] = 0
        self._ttft[s] = self.slo_guard.c_ttft_target(ttft_slo_s)
        self._tpot[s] = self.slo_guard.c_tpot_target(tpot_slo_s)
        self._arrive_t[s] = now
        self._engine_t[s] = arrival_time
        self._engine_tie[s] = arrival_tie
        self._session[s] = session if self.agent_window.enabled else -1
        self.agent_window.c_track(self._session[s], now)
        self._state[s] = ST_WAITING  # provisional, so helpers may read it
        return s

    cdef Rejection _refusal(self, int32_t s, double now):
        """Why the new request s can never be queued here (the KV pool, the prefill
        cap), or cannot now (its predicted queueing delay or TTFT); None: it may queue."""
        cdef bint backlog = not self._waiting.empty()
        if not self._fits_capacity(s, True):
            return self.gate.c_refuse(
                R_KV_CAPACITY,
                f"request needs more KV than the whole pool holds under policy "
                f"'{POLICIES[self._policy]}' (prompt_tokens={self._prompt[s]}, "
                f"max_new_tokens={self._max_new[s]}, pool={self.num_blocks} blocks of "
                f"{self.block_size} tokens)",
                "num_blocks", self.num_blocks, None, backlog)
        cdef int64_t queued = self._queued_of(s)
        cdef Rejection refused = self.gate.c_refuse_prefill(queued, backlog)
        if refused is not None:
            return refused
        cdef double delay
        cdef int64_t ahead = 0, ahead_tokens = 0
        cdef bint ttft_guarded = self.slo_guard.enabled and self._ttft[s] > 0
        if self.gate.max_queue_delay_s > 0 or ttft_guarded:
            self._ahead_of(s, &ahead, &ahead_tokens)
            delay = self._predicted_delay(ahead, ahead_tokens, queued, now)
        if self.gate.max_queue_delay_s > 0:
            refused = self.gate.c_refuse_delay(delay, self._waiting.size(), self._queued_tokens,
                                               not self._waiting.empty())
            if refused is not None:
                return refused
        if ttft_guarded:
            return self.gate.c_refuse_slo(
                self.slo_guard.c_predict_ttft(ahead_tokens, queued, delay, self._running.size(),
                                              self._running_context()),
                self._ttft[s], self._waiting.size(), self._running.size(), not self._waiting.empty())
        return None

    cdef Rejection _make_room(self, int32_t s, double now, list shed):
        """Room in the queue for the new request s under the caps: none needed, or
        strictly less important waiting requests shed (appended to `shed`); else the
        refusal of s."""
        cdef int64_t queued = self._queued_of(s)
        cdef int64_t over_reqs = 0, over_tokens = 0
        if self.gate.max_queued_requests > 0:
            over_reqs = <int64_t>self._waiting.size() + 1 - self.gate.max_queued_requests
        if self.gate.max_queued_tokens > 0:
            over_tokens = self._queued_tokens + queued - self.gate.max_queued_tokens
        if over_reqs <= 0 and over_tokens <= 0:
            return None
        if self.gate.shed_lower_priority and self._shed_for(self._priority[s], over_reqs, over_tokens,
                                                            now, shed):
            return None
        return self.gate.c_refuse_full(over_reqs, over_tokens, self._waiting.size(),
                                       self._queued_tokens, queued, now, not self._waiting.empty())

    cdef bint _shed_for(self, int64_t priority, int64_t over_reqs, int64_t over_tokens,
                        double now, list out):
        """Evicts strictly less important never-admitted waiting requests until the
        arrival fits; evicts nothing and returns False if that is not enough."""
        cdef cmap[QKey, int32_t].reverse_iterator it = self._shed_order.rbegin()
        cdef vector[int32_t] picked
        cdef int64_t reqs = over_reqs, toks = over_tokens
        cdef int32_t v
        while (reqs > 0 or toks > 0) and it != self._shed_order.rend():
            v = deref(it).second
            if self._priority[v] <= priority:
                break
            picked.push_back(v)
            reqs -= 1
            toks -= self._queued_of(v)
            inc(it)
        if reqs > 0 or toks > 0:
            return False
        for v in picked:
            self._dequeue(v)
            self._release(v)
            out.append((v, self.gate.c_refuse_shed(priority, self._priority[v], over_reqs > 0,
                                                   not self._waiting.empty())))
        return True

    # ------------------------------------------------------------------
    # Public API: admission
    def decide(self, int64_t slot, int64_t free_blocks, bint check_blocks=True):
        """What the policy says about one waiting request: 'admit', 'hold_blocks'
        (not enough free blocks now) or 'hold_capacity' (the policy's future rule).

        ``check_blocks=False`` leaves today's fit to the engine's own allocator
        (which knows prefix hits the core does not); the policy rule still applies."""
        self._check_slot(slot, ST_WAITING)
        return DECISIONS[self._decide(<int32_t>slot, free_blocks, check_blocks)]

    def plan_shortfall(self, want_tokens, computed_tokens, held_blocks, int64_t free_blocks,
                       int64_t token_budget, int64_t lookahead_tokens=0):
        """Which running requests to pause this step, under ``shortfall: "pause"``.

        One entry per running request, in the order the engine serves them:
        ``want_tokens`` it would compute this step (the engine's own caps applied,
        0 if the engine skips it anyway), ``computed_tokens`` it has KV for,
        ``held_blocks`` it holds. In that order each takes min(want, budget left)
        tokens and the blocks they need (plus ``lookahead_tokens``) while blocks
        last; one that finds too few is paused: skipped this step, its KV kept, and
        its tokens left to the requests behind it. Returns the positions paused:
        none under "preempt". When none could run, the first one that wanted to is
        not paused: the engine preempts its victims for it as usual (else no request
        would ever free a block). While any request is paused this step, no waiting
        request is admitted (held as "hold_paused").
        """
        cdef Py_ssize_t n = len(want_tokens)
        if len(computed_tokens) != n or len(held_blocks) != n:
            raise ValueError(f"want_tokens, computed_tokens and held_blocks must have one entry "
                             f"per running request: got {n}, {len(computed_tokens)}, {len(held_blocks)}")
        for name, v in (("free_blocks", free_blocks), ("token_budget", token_budget),
                        ("lookahead_tokens", lookahead_tokens)):
            if v < 0:
                raise ValueError(f"{name}={v}: must be >= 0")
        cdef vector[int64_t] want = _counts("want_tokens", want_tokens)
        cdef vector[int64_t] computed = _counts("computed_tokens", computed_tokens)
        cdef vector[int64_t] held = _counts("held_blocks", held_blocks)
        cdef vector[char] paused
        paused.assign(n, 0)
        self.c_plan_shortfall(want.data(), computed.data(), held.data(), n, free_blocks,
                              token_budget, lookahead_tokens, paused.data())
        return [i for i in range(n) if paused[i]]

    cdef int64_t c_plan_shortfall(self, const int64_t* want, const int64_t* computed,
                                  const int64_t* held, int64_t n, int64_t free_blocks,
                                  int64_t budget, int64_t lookahead, char* paused) noexcept nogil:
        cdef int64_t i, w, need, count = 0, served = 0, first = -1
        self._paused_now = 0
        if not self._pause_on_shortfall:
            return 0
        for i in range(n):
            paused[i] = 0
            w = want[i] if want[i] < budget else budget
            if w <= 0:
                continue            # the engine does not reach it this step anyway
            need = cdiv(computed[i] + w + lookahead, self.block_size) - held[i]
            if need <= free_blocks:
                free_blocks -= need if need > 0 else 0
                budget -= w
                served += 1
            else:
                paused[i] = 1
                count += 1
                if first < 0:
                    first = i
        if served == 0 and count > 0:
            # Nothing could run: the first runs, taking what the engine's victims give
            # back; the rest stay paused rather than each preempting in turn.
            paused[first] = 0
            count -= 1
        self._paused_now = count
        self._n_pauses += count
        return count

    def next_admissible(self, int64_t free_blocks, bint check_blocks=True):
        """The waiting request to admit next, or -1: the head, or under
        head_of_line='bypass' a later one that fits while the held ones ahead of it
        have been passed fewer than max_bypass times.

        A look that changes no decision; it counts the hold of the request at the
        head (stats()["held"], by reason) once per request per step (`on_step`),
        however often an engine looks within a step."""
        return self.c_next_admissible(free_blocks, check_blocks)

    cdef int32_t c_next_admissible(self, int64_t free_blocks, bint check_blocks) noexcept:
        if self._waiting.empty():
            return -1
        if self._paused_now:
            # Paused running requests have the first claim on blocks as they free up.
            self._count_hold(deref(self._waiting.begin()).second, D_HOLD_PAUSED)
            return -1
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        cdef int32_t s
        cdef int d
        cdef bint head = True
        cdef int64_t scanned = 0
        while it != self._waiting.end():
            s = deref(it).second
            d = self._decide(s, free_blocks, check_blocks)
            if d == D_ADMIT:
                return s
            if head:
                self._count_hold(s, d)
            # A request outside the agent window never blocks the queue; any other
            # held request does, unless bypass lets later ones pass it.
            if d != D_HOLD_AGENT:
                if not self._bypass or self._bypassed[s] >= self._max_bypass:
                    return -1
                if not head:
                    scanned += 1
                    if scanned >= self._lookahead:
                        return -1
            head = False
            inc(it)
        return -1

    cdef inline void _count_hold(self, int32_t s, int d) noexcept nogil:
        """Counts a hold once per request and step: held_total means (request, step)
        pairs in which the request at the head of the queue could not start."""
        if self._held_step[s] != self._step:
            self._held_step[s] = self._step
            self._held[d] += 1

    def admit(self, int64_t slot, double now=0.0):
        """Commits: the waiting request starts running. Requests it passed count a bypass."""
        self._check_slot(slot, ST_WAITING)
        if not isfinite(now):
            raise ValueError(f"now={now}: must be a finite number of seconds")
        self._admit(<int32_t>slot, now)

    cdef void _admit(self, int32_t s, double now) noexcept:
        self._note_time(now)
        self._advance(now)
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        while deref(it).second != s:
            if not self._agent_held(deref(it).second):
                self._bypassed[deref(it).second] += 1
            inc(it)
        if self._session[s] >= 0:
            self._activated_by[s] = self.agent_window.c_activate(self._session[s])
        cdef int64_t queued = self._queued_of(s)
        self._dequeue(s)
        self._admit_seq[s] = self._seq
        self._seq += 1
        self._admit_step[s] = self._step
        self._run_add(s)
        self._profile_insert(s)
        self._offsets_dirty = True
        if self._pred_total[s] == 0:
            self._pred_total[s] = self._generated[s] + (
                self._predict_remaining(s) if self._policy == P_ADAPTIVE or self._policy == P_AUTO
                else self._max_new[s] - self._generated[s])
        self._n_admitted += 1
        self._adapt_admits += 1
        self.gate.c_admitted(queued)
        self._maybe_adapt()

    def withdraw(self, int64_t slot):
        """Takes back an accepted arrival that never waited on its own: a sample of a
        parallel-sampling request whose sibling was refused (the request is one unit,
        refused once). Not counted as an arrival nor as an abort."""
        self._check_slot(slot, ST_WAITING)
        cdef int32_t s = <int32_t>slot
        if self._state[s] != ST_WAITING or self._admit_seq[s] >= 0:
            raise ValueError(f"slot {slot}: only a never-admitted waiting request can be withdrawn")
        self._dequeue(s)
        self._n_arrived -= 1
        self._release(s)

    def cancel_admit(self, int64_t slot, double now=0.0):
        """Undoes an admission the engine did not carry out (it put the request
        back before running it): running -> waiting, not counted as a preemption."""
        self._check_slot(slot, ST_RUNNING)
        cdef int32_t s = <int32_t>slot
        self._note_time(now)
        self._run_remove(s)
        self._shared[s] = 0             # it shares nothing until admitted again
        self._enqueue(s)
        self._n_admitted -= 1
        if self._adapt_admits > 0:
            self._adapt_admits -= 1
        self.gate.c_admission_undone()
        if self._session[s] >= 0 and self._activated_by[s]:
            self.agent_window.c_undo_activation(self._session[s])   # its admission is undone
        self._activated_by[s] = 0

    cdef void _maybe_adapt(self) noexcept:
        if (self._policy != P_ADAPTIVE and self._policy != P_AUTO) or self._adapt_admits < self._adapt_interval:
            return
        self._quantile = c_next_quantile(self._quantile, self._quantile_base, self._quantile_max,
                                         self._adapt_preempts, self._adapt_admits, self._target_preemption_rate)
        self._adapt_admits = 0
        self._adapt_preempts = 0
        self._profile_dirty = True

    # ------------------------------------------------------------------
    # Public API: progress reports from the engine
    def update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens):
        """The engine's counts for a request: tokens with KV computed, tokens generated."""
        self._update(slot, computed_tokens, generated_tokens)

    cdef int _update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens) except -1:
        self._check_live(slot)
        if generated_tokens < 0:
            raise ValueError(f"generated_tokens={generated_tokens}: must be >= 0")
        if computed_tokens < 0 or computed_tokens > self._prompt[slot] + generated_tokens:
            raise ValueError(f"computed_tokens={computed_tokens}: must be in "
                             f"[0, prompt_tokens + generated_tokens = {self._prompt[slot] + generated_tokens}]")
        cdef int32_t s = <int32_t>slot
        if self._state[s] == ST_WAITING:
            self._queued_tokens -= self._queued_of(s)
        self._computed[s] = computed_tokens
        if self._state[s] == ST_WAITING:
            self._generated[s] = generated_tokens
            self._queued_tokens += self._queued_of(s)
        else:
            self._run_ctx += generated_tokens - self._generated[s]
            self._generated[s] = generated_tokens
            self._dirty()
        return 0

    cdef void _progress(self, int32_t s, int64_t computed_tokens, int64_t generated_tokens) noexcept nogil:
        """`update` for a running request, unchecked (the native engine's hot path)."""
        self._computed[s] = computed_tokens
        self._run_ctx += generated_tokens - self._generated[s]
        self._generated[s] = generated_tokens
        self._dirty()

    def update_many(self, slots, computed_tokens, generated_tokens):
        """`update` for many requests at once (one call per engine step)."""
        cdef Py_ssize_t i, n = len(slots)
        if len(computed_tokens) != n or len(generated_tokens) != n:
            raise ValueError(f"update_many: {n} slots but {len(computed_tokens)} computed_tokens "
                             f"and {len(generated_tokens)} generated_tokens")
        for i in range(n):
            self._update(slots[i], computed_tokens[i], generated_tokens[i])

    def set_cached(self, int64_t slot, int64_t cached_tokens):
        """Prefix-cache hit the engine found for a waiting request (tokens)."""
        self._check_slot(slot, ST_WAITING)
        if cached_tokens < 0 or cached_tokens > self._tokens(<int32_t>slot):
            raise ValueError(f"cached_tokens={cached_tokens}: must be in [0, {self._tokens(<int32_t>slot)}]")
        self._queued_tokens -= self._queued_of(<int32_t>slot)
        self._cached[slot] = cached_tokens
        self._queued_tokens += self._queued_of(<int32_t>slot)

    def set_blocks(self, int64_t slot, int64_t blocks):
        """KV blocks the engine holds for a request (for accounting and metrics)."""
        self._check_live(slot)
        if blocks < 0:
            raise ValueError(f"blocks={blocks}: must be >= 0")
        self._blocks[slot] = blocks

    def on_step(self, double now=0.0):
        """Once per engine step, after its preemptions: advances the predict ratio."""
        self._advance(now)
        self._on_step()

    cdef void _on_step(self) noexcept nogil:
        self._step += 1
        if self._running.empty() and self._waiting.empty():
            self._ratio = self._predict_init_ratio
        elif not self._preempted_this_step:
            self._ratio = max(self._ratio - self._predict_ratio_decay, self._predict_min_ratio)
        self._preempted_this_step = False
        self._paused_now = 0
        self._offsets_dirty = True

    def preempt(self, int64_t slot, double now=0.0):
        """Commits: a running request gives its memory back and waits again
        (recompute: its KV is gone, its output so far is kept)."""
        self._check_slot(slot, ST_RUNNING)
        self._note_time(now)
        self._preempt(<int32_t>slot)

    cdef void _preempt(self, int32_t s) noexcept nogil:
        self._run_remove(s)
        self._computed[s] = 0
        self._cached[s] = 0
        self._blocks[s] = 0
        self._shared[s] = 0
        self._preempts[s] += 1
        self._enqueue(s)
        self._n_preempted += 1
        self._adapt_preempts += 1
        self._preempted_this_step = True
        # SGLang: after a retraction the ratio is re-estimated from the requests kept.
        cdef double gen = 0.0, mx = 0.0
        cdef size_t i
        for i in range(self._running.size()):
            gen += self._generated[self._running[i]]
            mx += self._max_new[self._running[i]]
        self._ratio = min(1.0, (gen + self._predict_retract_steps * <double>self._running.size()) / (mx + 1.0))

    def finish(self, int64_t slot, double now=0.0):
        """A running request is done; its output length feeds the length model."""
        self._check_slot(slot, ST_RUNNING)
        self._finish_at(<int32_t>slot, now)

    cdef inline void _advance(self, double now) noexcept nogil:
        """The latest `now` seen (sessions' idle clocks run on it)."""
        if now > self._last_now:
            self._last_now = now

    cdef void _finish_at(self, int32_t s, double now) noexcept nogil:
        """`finish`, unchecked (the native engine's path too)."""
        self._note_time(now)
        self._advance(now)
        self._finish(s)

    cdef void _finish(self, int32_t s) noexcept nogil:
        self._run_remove(s)
        if self._policy == P_AUTO:
            self._observe_capped(self._generated[s] >= self._max_new[s])
        if self._policy != P_AUTO or self._generated[s] < self._max_new[s]:
            self._lengths.c_observe(self._generated[s])
        self._n_len_obs += 1
        self._len_abs_err += llabs(self._pred_total[s] - self._generated[s])
        self._len_pred_sum += self._pred_total[s]
        self._len_actual_sum += self._generated[s]
        self._n_finished += 1
        self._release(s)

    cdef void _observe_capped(self, bint capped) noexcept nogil:
        self._capped_window.push_back(capped)
        self._n_capped += capped
        if <int64_t>self._capped_window.size() > self._lengths.c_window():   # the same window
            self._n_capped -= self._capped_window.front()
            self._capped_window.pop_front()

    def abort(self, int64_t slot, double now=0.0):
        """The request is gone (client cancelled, engine error): forget it."""
        self._check_live(slot)
        self._note_time(now)
        cdef int32_t s = <int32_t>slot
        if self._state[s] == ST_RUNNING:
            self._run_remove(s)
        else:
            self._dequeue(s)
        self._n_aborted += 1
        self._release(s)

    # ------------------------------------------------------------------
    # Public API: step-time model and agent window
    def set_step_budget(self, int64_t tokens):
        """The engine's token budget a step (vLLM max_num_batched_tokens), for TTFT predictions."""
        if tokens < 0:
            raise ValueError(f"step budget tokens={tokens}: must be >= 0 (0: unknown)")
        self.slo_guard.c_set_step_budget(tokens)

    def observe_step(self, double tokens, double context, double seconds):
        """An engine step took `seconds` for `tokens` scheduled tokens over `context`
        tokens of KV: refines the step-time model the SLO guard predicts with."""
        self.slo_guard.observe_step(tokens, context, seconds)

    @property
    def step_time(self):
        """The step-time fit the SLO guard predicts with (kvadmit.StepTimeFit)."""
        return self.slo_guard.step_time

    def predict_ttft(self, int64_t prompt_tokens, double now):
        """The TTFT the SLO guard predicts for an arrival of `prompt_tokens` at
        `now` (queued behind everything waiting)."""
        cdef int32_t s = self._new_slot()      # a probe at the back of the queue
        self._prompt[s] = prompt_tokens
        self._generated[s] = self._cached[s] = 0
        self._arrival[s] = self._seq
        self._arrive_t[s] = now
        self._engine_t[s] = self._engine_tie[s] = 0.0
        self._ttft[s] = 0.0
        self._priority[s] = INT64_MAX // 2
        cdef int64_t ahead, ahead_tokens
        self._ahead_of(s, &ahead, &ahead_tokens)
        self._release(s)
        cdef double delay = self._predicted_delay(ahead, ahead_tokens, prompt_tokens, now)
        return self.slo_guard.c_predict_ttft(ahead_tokens, prompt_tokens, delay, self._running.size(),
                                             self._running_context())

    def observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                      double now=0.0):
        """Once per engine step: KV blocks in use and the step's prefix-cache hit and
        query tokens. Every agent_interval_steps the agent window follows AIMD."""
        self._c_observe_cache(used_blocks, hit_tokens, query_tokens, now)

    cdef void _c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                               double now) noexcept nogil:
        if not self.agent_window.enabled:
            return
        self._advance(now)
        self.agent_window.c_observe_cache(used_blocks, hit_tokens, query_tokens, self._last_now)

    cdef inline int64_t _shared_term(self) noexcept nogil:
        """Blocks auto adds to the own curves: those in use that no running request
        owns, and at least the longest shared prefix. A prefix stays in use while any
        request sharing it runs, also after its first holder (whose own curve counts
        it) finishes; until then it is in no one's unowned count. (With several
        distinct shared prefixes whose first holders still run, only the longest is
        covered so.)"""
        return self._unowned_blocks if self._unowned_blocks > self._max_shared_blocks \
            else self._max_shared_blocks

    cdef int64_t _count_unowned(self, int64_t used_blocks) noexcept nogil:
        """Blocks in use beyond the running requests' own parts (their context less the
        prefix they share): the shared prefixes, counted once and assumed held while
        anything runs. Under auto a request's curve counts only its own part, so a
        prefix many requests share is not counted once per request (peak and adaptive
        count it per request: their bound stays a bound)."""
        cdef int64_t own = 0, shared
        cdef size_t i
        cdef int32_t r
        self._max_shared_blocks = 0
        for i in range(self._running.size()):
            r = self._running[i]
            shared = self._shared[r] // self.block_size
            own += cdiv(self._computed[r], self.block_size) - shared
            if shared > self._max_shared_blocks:
                self._max_shared_blocks = shared
        return used_blocks - own if used_blocks > own else 0

    def observe_used_blocks(self, int64_t used_blocks):
        """Once per engine step, after `update_many`: KV blocks in use (auto counts the
        prefixes running requests share once)."""
        if used_blocks < 0:
            raise ValueError(f"used_blocks={used_blocks}: must be >= 0")
        self.c_observe_used_blocks(used_blocks)

    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil:
        if self._policy == P_AUTO:
            self._unowned_blocks = self._count_unowned(used_blocks)

    def set_shared(self, int64_t slot, int64_t shared_tokens):
        """At admission: prompt tokens of a request that sit in KV blocks other running
        requests already hold (prefix-cache hits on blocks in use). Only auto uses it."""
        self._check_live(slot)
        if shared_tokens < 0 or shared_tokens > self._tokens(<int32_t>slot):
            raise ValueError(f"shared_tokens={shared_tokens}: must be in [0, {self._tokens(<int32_t>slot)}]")
        self.c_set_shared(<int32_t>slot, shared_tokens)

    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil:
        if self._policy != P_AUTO or self._shared[s] == shared_tokens:
            return
        self._shared[s] = shared_tokens
        if shared_tokens // self.block_size > self._max_shared_blocks:
            self._max_shared_blocks = shared_tokens // self.block_size
        self._profile_dirty = True

    def next_session_expiry(self):
        """When the first active idle session leaves the agent window (inf: none).
        An engine with only window-held requests waiting can sleep until then."""
        return self.agent_window.c_next_expiry()

    def expire_sessions(self, double now):
        """Lets idle sessions leave the window as of `now` (engines call it when idle;
        observe_cache does it every step while the window is full)."""
        self._advance(now)
        self.agent_window.c_expire_idle(self._last_now)

    def take_paused_sessions(self):
        """Sessions paused or expired since the last call (an engine can demote
        their cached prefixes)."""
        return self.agent_window.take_paused_sessions()

    def session_active(self, int64_t session):
        """Whether this session is inside the agent window (True without agent_window)."""
        return self.agent_window.c_is_active(session)

    @property
    def agent_window_size(self):
        """The current W (the number of sessions that may be active)."""
        return self.agent_window.c_size()

    @property
    def active_sessions(self):
        return self.agent_window.c_active()

    def window_history(self):
        """W after each AIMD update, oldest first."""
        return self.agent_window.history()

    # ------------------------------------------------------------------
    # Public API: victims
    cdef VictimKey _victim_key(self, int32_t s) noexcept nogil:
        cdef VictimKey k
        k.slot = s
        if self._victim == V_LIFO:
            k.k1 = self._admit_seq[s]; k.k2 = self._arrival[s]; k.k3 = 0
        elif self._victim == V_PRIORITY:
            k.k1 = self._priority[s]; k.k2 = -self._computed[s]; k.k3 = self._arrival[s]
        elif self._victim == V_LCF:
            k.k1 = -self._computed[s]; k.k2 = self._arrival[s]; k.k3 = 0
        else:  # length: fewest generated, then longest prompt
            k.k1 = -self._generated[s]; k.k2 = self._prompt[s]; k.k3 = self._arrival[s]
        return k

    def victim(self):
        """The running request to preempt first, or -1."""
        return self._victim_slot()

    cdef int32_t _victim_slot(self) noexcept nogil:
        if self._running.empty():
            return -1
        cdef VictimKey best = self._victim_key(self._running[0])
        cdef VictimKey k
        cdef size_t i
        for i in range(1, self._running.size()):
            k = self._victim_key(self._running[i])
            if victim_key_less(best, k):
                best = k
        return best.slot

    def victim_order(self):
        """Running slots from most protected to first victim (the last one goes first)."""
        cdef vector[VictimKey] keys
        cdef size_t i
        for i in range(self._running.size()):
            keys.push_back(self._victim_key(self._running[i]))
        sort(keys.begin(), keys.end(), victim_key_less)
        return [k.slot for k in keys]

    # ------------------------------------------------------------------
    # Public API: state
    @property
    def paused(self):
        """Running requests paused so far, counted per step (shortfall: "pause")."""
        return self._n_pauses

    @property
    def num_waiting(self):
        return self._waiting.size()

    @property
    def num_running(self):
        return self._running.size()

    @property
    def queued_tokens(self):
        return self._queued_tokens

    @property
    def new_token_ratio(self):
        """The predict policy's current ratio (SGLang's new_token_ratio)."""
        return self._ratio

    @property
    def quantile(self):
        """The adaptive policy's current length quantile."""
        return self._quantile

    @property
    def length_model(self):
        return self._lengths

    def waiting(self):
        """Waiting slots in service order."""
        cdef list out = []
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        while it != self._waiting.end():
            out.append(deref(it).second)
            inc(it)
        return out

    def running(self):
        """Running slots (no particular order; see victim_order)."""
        return [s for s in self._running]

    def state(self, int64_t slot):
        if slot < 0 or slot >= <int64_t>self._state.size():
            return "free"
        return STATES[<int>self._state[slot]]

    def info(self, int64_t slot):
        """The ledger's numbers for one request."""
        self._check_live(slot)
        return {
            "state": self.state(slot), "prompt_tokens": self._prompt[slot],
            "cached_tokens": self._cached[slot], "computed_tokens": self._computed[slot],
            "generated_tokens": self._generated[slot], "max_new_tokens": self._max_new[slot],
            "priority": self._priority[slot], "arrival": self._arrival[slot],
            "arrival_time": self._engine_t[slot],
            "blocks": self._blocks[slot], "bypassed": self._bypassed[slot],
            "preemptions": self._preempts[slot],
        }

    def peak_blocks(self):
        """Peak blocks the running requests can reach under the policy's curves."""
        self._ensure_profile()
        return peak_blocks_sorted(self._profile.data(), self._profile.size(), NULL,
                                  self.block_size, INT64_MAX, self._fenwick)

    @property
    def reserved_blocks(self):
        """Sum over running of blocks for prompt + max_new (the reserve policy's load)."""
        return self._reserve_sum

    cdef int64_t _forecast_blocks(self):
        """Blocks the running requests will hold at most, as the policy forecasts it:
        the peak of their curves (peak, adaptive, auto with its shared prefixes), their
        reservations (reserve), or what they hold now (overcommit; predict adds its
        ratio of their remaining tokens)."""
        cdef int64_t held = 0
        cdef size_t i
        if self._policy == P_PEAK or self._policy == P_ADAPTIVE or self._policy == P_AUTO:
            self._ensure_profile()
            return peak_blocks_sorted(self._profile.data(), self._profile.size(), NULL,
                                      self.block_size, INT64_MAX, self._fenwick) \
                + (self._shared_term() if self._policy == P_AUTO else 0)
        if self._policy == P_RESERVE:
            return self._reserve_sum
        for i in range(self._running.size()):
            held += cdiv(self._computed[self._running[i]], self.block_size)
        if self._policy == P_PREDICT:
            held += <int64_t>ceil(self._offsets() / self.block_size)
        return held

    def router_signals(self):
        """What a router in front of several engines can use (kvadmit knows it, their
        gauges do not): ``kv_headroom_blocks``, the blocks the policy could still admit
        without a forecast shortfall once the waiting requests' prompts are in;
        ``admission_pressure``, the forecast plus those prompts over the pool (above 1:
        more is queued than fits); ``predicted_queue_delay_s``, the wait of a request
        arriving now behind the queue at the recent admission rate (0 when none is
        known or nothing waits)."""
        cdef int64_t demand = self._forecast_blocks() + cdiv(self._queued_tokens, self.block_size)
        return {
            "kv_headroom_blocks": max(self.num_blocks - demand, 0),
            "admission_pressure": demand / <double>self.num_blocks,
            "predicted_queue_delay_s": self._predicted_delay(
                self._waiting.size(), self._queued_tokens, 0, self._last_now),
        }

    def stats(self):
        """Counters since construction, and the router signals."""
        return {
            **self.router_signals(),
            "arrived": self._n_arrived, "admitted": self._n_admitted,
            "preempted": self._n_preempted, "paused": self.paused,
            "finished": self._n_finished, "aborted": self._n_aborted,
            "held": {DECISIONS[i]: self._held[i] for i in range(1, N_DECISIONS)},
            "rejected": self.gate.rejected(),
            "waiting": self._waiting.size(), "running": self._running.size(),
            "queued_tokens": self._queued_tokens,
            "new_token_ratio": self._ratio, "quantile": self._quantile,
            "step_time_fit": dict(zip(("a", "b", "c"), self.step_time.coefficients),
                                  observations=self.step_time.observations),
            "agent_window": self.agent_window.stats(),
            "length_predictions": {
                "finished": self._n_len_obs,
                "mean_predicted": self._len_pred_sum / self._n_len_obs if self._n_len_obs else 0.0,
                "mean_actual": self._len_actual_sum / self._n_len_obs if self._n_len_obs else 0.0,
                "mean_abs_error": self._len_abs_err / self._n_len_obs if self._n_len_obs else 0.0,
            },
        }
