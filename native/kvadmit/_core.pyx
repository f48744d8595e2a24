# The admission core: the queue and what happens to a request, over its parts.
#
# Engine-agnostic and clock-free: the caller passes `now` (seconds) and the
# engine's current free blocks. Query, then commit: `next_admissible` / `decide`
# only look, `admit` / `preempt` / `finish` change state. The parts, each its own
# module: the ledger (kvadmit._ledger: every request's numbers), the policy
# (kvadmit._policies: may a waiting request start?), the arrival gate
# (kvadmit._arrival_gate: caps, refusals, Retry-After), the SLO guard
# (kvadmit._slo_guard), the agent window (kvadmit._agent_window) and victim order
# (kvadmit._victims). This module keeps the waiting queue, its order and the
# counters, and calls each part where a request arrives, waits, starts, stops.

from cython.operator cimport dereference as deref, preincrement as inc
from libc.math cimport isfinite
from libc.stdlib cimport llabs
from libc.stdint cimport int32_t, int64_t, INT64_MAX
from libcpp.map cimport map as cmap
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._arrival_gate cimport (ArrivalGate, ArrivalResult, Rejection, R_INVALID,
                                    R_KV_CAPACITY, R_QUEUE_FULL)
from kvadmit._curves cimport cdiv
from kvadmit._ledger cimport Ledger, ST_FREE, ST_RUNNING, ST_WAITING
from kvadmit._policies cimport Policy, make_policy
from kvadmit._slo_guard cimport SloGuard
from kvadmit._victims cimport victim_order, victim_slot

from kvadmit._ledger import STATES
from kvadmit._policies import POLICIES
from kvadmit._victims import VICTIMS

DECISIONS = ("admit", "hold_blocks", "hold_capacity", "hold_slo", "hold_agent", "hold_paused")

cdef vector[int64_t] _counts(str name, values) except *:
    """A sequence of counts (>= 0) as a native vector; a negative one names its index."""
    cdef vector[int64_t] v
    for i, x in enumerate(values):
        if x < 0:
            raise ValueError(f"{name}[{i}]={x}: must be >= 0")
        v.push_back(x)
    return v


cdef inline int _check_now(double now) except -1:
    """Every entry point's clock: a non-finite `now` would stop the core's clocks
    (nothing is later than inf) and with them the drain rate and idle expiry."""
    if not isfinite(now):
        raise ValueError(f"now={now}: must be a finite number of seconds")
    return 0


cdef class AdmissionCore:
    """Decides which waiting request takes KV memory, which waits, which is
    refused and which running request gives memory back.

    ``config`` is a `kvadmit.AdmissionConfig`; ``num_blocks`` and
    ``block_size`` describe the engine's KV pool, ``max_model_len`` its
    context limit (0: no limit).
    """
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
        self.ledger = Ledger(block_size, config.prefill_chunk_tokens)
        self.policy = make_policy(config, self.ledger, num_blocks, max_model_len)
        self._victim = VICTIMS.index(config.victim)
        self._priority_order = config.queue_order == "priority"
        self._bypass = config.bypass_head_of_line
        self._pause_on_shortfall = config.pause_on_shortfall
        self._max_bypass = config.max_bypass
        self._lookahead = config.bypass_lookahead
        if config.head_of_line == "auto" and self._bypass:
            self._max_bypass, self._lookahead = AUTO_MAX_BYPASS, AUTO_LOOKAHEAD
        self.gate = ArrivalGate(config)
        self.slo_guard = SloGuard(config)
        self._deadline_order = config.queue_order == "deadline"
        self.agent_window = AgentWindow(config, num_blocks)
        self._last_now = 0.0
        self._queued_tokens = self._seq = 0
        self._n_arrived = self._n_admitted = self._n_preempted = 0
        self._n_finished = self._n_aborted = self._n_len_obs = 0
        self._paused_now = self._n_pauses = 0
        cdef int i
        for i in range(N_DECISIONS):
            self._held[i] = 0
        self._len_abs_err = self._len_pred_sum = self._len_actual_sum = 0.0

    # ------------------------------------------------------------------
    # The decision
    cdef inline double _running_context(self) noexcept nogil:
        return <double>self.ledger.run_ctx

    cdef bint _tpot_ok(self, int32_t s) noexcept nogil:
        return self.slo_guard.c_tpot_ok(self.ledger.tpot[s], self.ledger.running.size(),
                                        self._running_context() + self.ledger.tokens(s))

    cdef inline bint _agent_held(self, int32_t s) noexcept nogil:
        return self.agent_window.c_holds(self.ledger.session[s])

    cdef int _decide(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil:
        if self._agent_held(s):
            return D_HOLD_AGENT
        cdef int d = self._decide_memory(s, free_blocks, check_blocks)
        if d == D_ADMIT and not self._tpot_ok(s):
            return D_HOLD_SLO
        return d

    cdef int _decide_memory(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil:
        cdef int64_t need_now = cdiv(self.ledger.tokens(s), self.block_size) - self.ledger.cached[s] // self.block_size
        if check_blocks and need_now > free_blocks:
            return D_HOLD_BLOCKS
        if not self.policy.c_fits(s, free_blocks):
            return D_HOLD_CAPACITY
        return D_ADMIT

    # ------------------------------------------------------------------
    # Queue order
    cdef inline QKey _qkey(self, int32_t s) noexcept nogil:
        return self._order_key(self.ledger.priority[s], self.ledger.arrive_t[s], self.ledger.ttft[s],
                               self.ledger.engine_t[s], self.ledger.engine_tie[s], self.ledger.arrival[s])

    cdef inline QKey _order_key(self, int64_t priority, double arrive_t, double ttft, double engine_t,
                                double engine_tie, int64_t arrival) noexcept nogil:
        """The queue's key of a request with these numbers (see QKey)."""
        cdef QKey k
        k.first = priority if self._priority_order else 0
        if self._deadline_order:   # microseconds; no target: an hour after arrival
            k.first = <int64_t>((arrive_t + (ttft if ttft > 0 else 3600.0)) * 1e6)
        k.time = engine_t if self._priority_order else 0.0
        k.tie = engine_tie if self._priority_order else 0.0
        k.second = arrival
        return k

    cdef inline QKey _shed_key(self, int32_t s) noexcept nogil:
        cdef QKey k
        k.first = self.ledger.priority[s]
        k.time = self.ledger.engine_t[s] if self._priority_order else 0.0
        k.tie = self.ledger.engine_tie[s] if self._priority_order else 0.0
        k.second = self.ledger.arrival[s]
        return k

    cdef void _enqueue(self, int32_t s) noexcept nogil:
        self.ledger.state[s] = ST_WAITING
        self._waiting[self._qkey(s)] = s
        self._queued_tokens += self.ledger.queued_of(s)
        self.agent_window.c_queued(self.ledger.session[s])

    cdef void _dequeue(self, int32_t s) noexcept nogil:
        self._waiting.erase(self._qkey(s))
        self._queued_tokens -= self.ledger.queued_of(s)
        self.agent_window.c_unqueued(self.ledger.session[s], self._last_now)
        if self.ledger.sheddable[s]:
            self._shed_order.erase(self._shed_key(s))
            self.ledger.sheddable[s] = 0

    cdef void _run_add(self, int32_t s) noexcept nogil:
        self.ledger.run_add(s)
        self.slo_guard.c_started(self.ledger.tpot[s])
        self.agent_window.c_started(self.ledger.session[s])

    cdef void _run_remove(self, int32_t s) noexcept nogil:
        self.ledger.run_remove(s)
        self.policy.c_running_changed()
        self.slo_guard.c_stopped(self.ledger.tpot[s])
        self.agent_window.c_stopped(self.ledger.session[s], self._last_now)

    # ------------------------------------------------------------------
    # Drain rate and Retry-After
    # Two clocks. The backlog clock (`_note_time`, the arrival gate's: seconds with
    # requests waiting, for the drain rate) and the latest time seen (`_advance`:
    # sessions' idle clocks, router signals). arrive, admit and finish tick both
    # (`_tick`); preempt, cancel_admit and abort only the backlog clock; on_step,
    # observe_cache (agent window on) and expire_sessions only the latest time. One
    # clock everywhere would move the agents' idle clocks at a preemption and sample
    # the backlog clock where an engine replays arrivals late (the native engine):
    # other decisions, so the mix stays as it is, named here.
    cdef inline void _tick(self, double now) noexcept nogil:
        self._note_time(now)
        self._advance(now)

    cdef inline void _note_time(self, double now) noexcept nogil:
        """The arrival gate's backlog clock (it runs while anything waits)."""
        self.gate.c_note_time(now, not self._waiting.empty())

    cdef inline void _advance(self, double now) noexcept nogil:
        """The latest `now` seen (sessions' idle clocks run on it)."""
        if now > self._last_now:
            self._last_now = now

    cdef inline double _predicted_delay(self, int64_t ahead, int64_t ahead_tokens, int64_t queued,
                                        double now) noexcept nogil:
        return self.gate.c_predicted_delay(ahead, ahead_tokens, queued, now, not self._waiting.empty())

    cdef void _ahead_of(self, QKey key, int64_t* reqs, int64_t* tokens) noexcept nogil:
        """Waiting requests (and their prefill tokens) that the queue order serves
        before a request with this key: all of them in arrival order (a new arrival
        is last), else a walk to its position (skipping requests held outside the
        agent window: they do not block it)."""
        if not self._priority_order and not self._deadline_order and not self.agent_window.enabled:
            reqs[0] = self._waiting.size()
            tokens[0] = self._queued_tokens
            return
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        reqs[0] = tokens[0] = 0
        while it != self._waiting.end() and deref(it).first < key:
            if not self._agent_held(deref(it).second):   # held ones do not block it
                reqs[0] += 1
                tokens[0] += self.ledger.queued_of(deref(it).second)
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
        _check_now(now)
        if not isfinite(ttft_slo_s) or not isfinite(tpot_slo_s):
            raise ValueError(f"ttft_slo_s={ttft_slo_s}, tpot_slo_s={tpot_slo_s}: must be finite")
        if not isfinite(arrival_time) or not isfinite(arrival_tie):
            raise ValueError(f"arrival_time={arrival_time}, arrival_tie={arrival_tie}: must be finite")
        self._tick(now)
        self._n_arrived += 1
        cdef Rejection refused = self.gate.c_refuse_context(prompt_tokens, max_new_tokens,
                                                            self.max_model_len, not self._waiting.empty())
        if refused is not None:
            return ArrivalResult(False, -1, refused, [])
        cdef int32_t s = self._new_request(prompt_tokens, max_new_tokens, priority, cached_tokens, now,
                                           ttft_slo_s, tpot_slo_s, session, arrival_time, arrival_tie)
        cdef list shed = []
        self._judging(s)
        refused = self._refusal(s, now)
        if refused is None:
            refused = self._make_room(s, now, shed)
        if refused is not None:
            self.ledger.release(s)
            return ArrivalResult(False, -1, refused, [])
        self._enqueue(s)
        self.ledger.sheddable[s] = 1
        self._shed_order[self._shed_key(s)] = s
        return ArrivalResult(True, s, None, shed)

    cdef int32_t _new_request(self, int64_t prompt_tokens, int64_t max_new_tokens, int64_t priority,
                              int64_t cached_tokens, double now, double ttft_slo_s, double tpot_slo_s,
                              int64_t session, double arrival_time, double arrival_tie):
        """A slot holding an arrival's numbers, not yet queued (its state is waiting
        so the policies may read it)."""
        cdef int32_t s = self.ledger.new_slot()
        self.ledger.prompt[s] = prompt_tokens
        self.ledger.cached[s] = cached_tokens
        self.ledger.computed[s] = 0
        self.ledger.generated[s] = 0
        self.ledger.max_new[s] = max_new_tokens
        self.ledger.priority[s] = priority
        self.ledger.arrival[s] = self._seq
        self._seq += 1
        self.ledger.admit_seq[s] = -1
        self.ledger.admit_step[s] = -1
        self.ledger.held_step[s] = -1
        self.ledger.blocks[s] = 0
        self.ledger.shared[s] = 0
        self.ledger.bypassed[s] = 0
        self.ledger.preempts[s] = 0
        self.ledger.pred_total[s] = 0
        self.ledger.ttft[s] = self.slo_guard.c_ttft_target(ttft_slo_s)
        self.ledger.tpot[s] = self.slo_guard.c_tpot_target(tpot_slo_s)
        self.ledger.arrive_t[s] = now
        self.ledger.engine_t[s] = arrival_time
        self.ledger.engine_tie[s] = arrival_tie
        self.ledger.session[s] = session if self.agent_window.enabled else -1
        self.agent_window.c_track(self.ledger.session[s], now)
        self.ledger.state[s] = ST_WAITING  # provisional, so helpers may read it
        return s

    cdef inline void _judging(self, int32_t s) noexcept nogil:
        """Tells the gate which request its next refusal is of (its retry line
        knows a request back early by these numbers)."""
        self.gate.c_request(self.ledger.prompt[s], self.ledger.max_new[s], self.ledger.priority[s],
                            self.ledger.session[s], self.ledger.step)

    cdef Rejection _refusal(self, int32_t s, double now):
        """Why the new request s can never be queued here (the KV pool, the prefill
        cap), or cannot now (its predicted queueing delay or TTFT); None: it may queue."""
        cdef bint backlog = not self._waiting.empty()
        if not self.policy.c_fits_alone(s):
            return self.gate.c_refuse(
                R_KV_CAPACITY,
                f"request needs more KV than the whole pool holds under policy "
                f"'{POLICIES[self.policy.kind]}' (prompt_tokens={self.ledger.prompt[s]}, "
                f"max_new_tokens={self.ledger.max_new[s]}, pool={self.num_blocks} blocks of "
                f"{self.block_size} tokens)",
                "num_blocks", self.num_blocks, None, backlog)
        cdef int64_t queued = self.ledger.queued_of(s)
        cdef Rejection refused = self.gate.c_refuse_prefill(queued, backlog)
        if refused is not None:
            return refused
        cdef double delay = 0.0
        cdef int64_t ahead = 0, ahead_tokens = 0
        cdef bint ttft_guarded = self.slo_guard.enabled and self.ledger.ttft[s] > 0
        if self.gate.max_queue_delay_s > 0 or ttft_guarded:
            self._ahead_of(self._qkey(s), &ahead, &ahead_tokens)
            delay = self._predicted_delay(ahead, ahead_tokens, queued, now)
        if self.gate.max_queue_delay_s > 0:
            refused = self.gate.c_refuse_delay(delay, self._waiting.size(), self._queued_tokens,
                                               not self._waiting.empty())
            if refused is not None:
                return refused
        if ttft_guarded:
            return self.gate.c_refuse_slo(
                self.slo_guard.c_predict_ttft(ahead_tokens, queued, delay, self.ledger.running.size(),
                                              self._running_context()),
                self.ledger.ttft[s], self._waiting.size(), self.ledger.running.size(), not self._waiting.empty())
        return None

    cdef Rejection _make_room(self, int32_t s, double now, list shed):
        """Room in the queue for the new request s under the caps: none needed, or
        strictly less important waiting requests shed (appended to `shed`); else the
        refusal of s."""
        cdef int64_t queued = self.ledger.queued_of(s)
        cdef int64_t over_reqs = 0, over_tokens = 0
        if self.gate.max_queued_requests > 0:
            over_reqs = <int64_t>self._waiting.size() + 1 - self.gate.max_queued_requests
        if self.gate.max_queued_tokens > 0:
            over_tokens = self._queued_tokens + queued - self.gate.max_queued_tokens
        if over_reqs <= 0 and over_tokens <= 0:
            return None
        if self.gate.shed_lower_priority and self._shed_for(self.ledger.priority[s], over_reqs, over_tokens,
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
            if self.ledger.priority[v] <= priority:
                break
            picked.push_back(v)
            reqs -= 1
            toks -= self.ledger.queued_of(v)
            inc(it)
        if reqs > 0 or toks > 0:
            return False
        for v in picked:
            self._dequeue(v)
            self._judging(v)
            self.ledger.release(v)
            out.append((v, self.gate.c_refuse_shed(priority, self.ledger.priority[v], over_reqs > 0,
                                                   not self._waiting.empty())))
        return True

    # ------------------------------------------------------------------
    # Public API: admission
    def decide(self, int64_t slot, int64_t free_blocks, bint check_blocks=True):
        """What the policy says about one waiting request: 'admit', 'hold_blocks'
        (not enough free blocks now) or 'hold_capacity' (the policy's future rule).

        ``check_blocks=False`` leaves today's fit to the engine's own allocator
        (which knows prefix hits the core does not); the policy rule still applies."""
        self.ledger.check_state(slot, ST_WAITING)
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

    cdef int32_t c_next_admissible(self, int64_t free_blocks, bint check_blocks) noexcept nogil:
        self.policy.c_scan_begin()
        cdef int32_t s = self._scan_queue(free_blocks, check_blocks)
        self.policy.c_scan_end()
        return s

    cdef int32_t _scan_queue(self, int64_t free_blocks, bint check_blocks) noexcept nogil:
        """The first waiting request that may start now, in queue order with bypass
        (-1: none); counts the head's hold."""
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
                if not self._bypass or self.ledger.bypassed[s] >= self._max_bypass \
                        or self._waited_out(s):
                    return -1
                if not head:
                    scanned += 1
                    if scanned >= self._lookahead:
                        return -1
            head = False
            inc(it)
        return -1

    cdef inline bint _waited_out(self, int32_t s) noexcept nogil:
        """s has waited max_queue_delay_s (as of the latest time seen): no later
        request passes it any more. Bypass alone lets a large request be passed for
        as long as small ones fit, far past the delay the gate let it queue for."""
        return self.gate.max_queue_delay_s > 0 and \
            self._last_now - self.ledger.arrive_t[s] >= self.gate.max_queue_delay_s

    cdef inline void _count_hold(self, int32_t s, int d) noexcept nogil:
        """Counts a hold once per request and step: held_total means (request, step)
        pairs in which the request at the head of the queue could not start."""
        if self.ledger.held_step[s] != self.ledger.step:
            self.ledger.held_step[s] = self.ledger.step
            self._held[d] += 1

    def admit(self, int64_t slot, double now=0.0):
        """Commits: the waiting request starts running. Requests it passed count a bypass."""
        self.ledger.check_state(slot, ST_WAITING)
        _check_now(now)
        self.c_admit(<int32_t>slot, now)

    cdef void c_admit(self, int32_t s, double now) noexcept nogil:
        self._tick(now)
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        cdef int32_t passed
        while deref(it).second != s:
            passed = deref(it).second
            if not self._agent_held(passed):
                self.ledger.bypassed[passed] = self.ledger.bypassed[passed] + 1
            inc(it)
        if self.ledger.session[s] >= 0:
            self.ledger.activated_by[s] = self.agent_window.c_activate(self.ledger.session[s])
        cdef int64_t queued = self.ledger.queued_of(s)
        self._dequeue(s)
        self.ledger.admit_seq[s] = self._seq
        self._seq += 1
        self.ledger.admit_step[s] = self.ledger.step
        self._run_add(s)
        self.policy.c_on_admit(s)
        if self.ledger.pred_total[s] == 0:
            self.ledger.pred_total[s] = self.ledger.generated[s] + self.policy.c_expected_output(s)
        self._n_admitted += 1
        self.gate.c_admitted(queued)
        self.policy.c_after_admit()

    def withdraw(self, int64_t slot):
        """Takes back an accepted arrival that never waited on its own: a sample of a
        parallel-sampling request whose sibling was refused (the request is one unit,
        refused once). Not counted as an arrival nor as an abort."""
        self.ledger.check_state(slot, ST_WAITING)
        cdef int32_t s = <int32_t>slot
        if self.ledger.state[s] != ST_WAITING or self.ledger.admit_seq[s] >= 0:
            raise ValueError(f"slot {slot}: only a never-admitted waiting request can be withdrawn")
        self._dequeue(s)
        self._n_arrived -= 1
        self.ledger.release(s)

    def cancel_admit(self, int64_t slot, double now=0.0):
        """Undoes an admission the engine did not carry out (it put the request
        back before running it): running -> waiting, not counted as a preemption."""
        self.ledger.check_state(slot, ST_RUNNING)
        _check_now(now)
        cdef int32_t s = <int32_t>slot
        self._note_time(now)
        self._run_remove(s)
        self.ledger.shared[s] = 0             # it shares nothing until admitted again
        self._enqueue(s)
        self._n_admitted -= 1
        self.policy.c_admission_undone()
        self.gate.c_admission_undone()
        if self.ledger.session[s] >= 0 and self.ledger.activated_by[s]:
            self.agent_window.c_undo_activation(self.ledger.session[s])   # its admission is undone
        self.ledger.activated_by[s] = 0

    # ------------------------------------------------------------------
    # Public API: progress reports from the engine
    def update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens):
        """The engine's counts for a request: tokens with KV computed, tokens generated."""
        self._update(slot, computed_tokens, generated_tokens)

    cdef int _update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens) except -1:
        self._check_update(slot, computed_tokens, generated_tokens)
        self._apply_update(<int32_t>slot, computed_tokens, generated_tokens)
        return 0

    cdef int _check_update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens) except -1:
        self.ledger.check_live(slot)
        if generated_tokens < 0:
            raise ValueError(f"generated_tokens={generated_tokens}: must be >= 0")
        if computed_tokens < 0 or computed_tokens > self.ledger.prompt[slot] + generated_tokens:
            raise ValueError(f"computed_tokens={computed_tokens}: must be in "
                             f"[0, prompt_tokens + generated_tokens = {self.ledger.prompt[slot] + generated_tokens}]")
        return 0

    cdef void _apply_update(self, int32_t s, int64_t computed_tokens, int64_t generated_tokens) noexcept nogil:
        self._queued_tokens += self.ledger.set_counts(s, computed_tokens, generated_tokens)
        if self.ledger.state[s] == ST_RUNNING:
            self.policy.c_running_changed()

    cdef void c_progress(self, int32_t s, int64_t computed_tokens, int64_t generated_tokens) noexcept nogil:
        """`update` for a running request, unchecked (the native engine's hot path)."""
        self.ledger.set_counts(s, computed_tokens, generated_tokens)
        self.policy.c_running_changed()

    def update_many(self, slots, computed_tokens, generated_tokens):
        """`update` for many requests at once (one call per engine step). Every
        entry is checked before any is applied: a refused call changes nothing."""
        cdef Py_ssize_t i, n = len(slots)
        if len(computed_tokens) != n or len(generated_tokens) != n:
            raise ValueError(f"update_many: {n} slots but {len(computed_tokens)} computed_tokens "
                             f"and {len(generated_tokens)} generated_tokens")
        if <Py_ssize_t>self._batch.size() < 3 * n:
            self._batch.resize(3 * n)       # kept between calls: no allocation a step
        cdef int64_t* row = self._batch.data()
        cdef int64_t slot, computed, generated, live = self.ledger.state.size()
        for i in range(n):
            slot, computed, generated = slots[i], computed_tokens[i], generated_tokens[i]
            if (slot < 0 or slot >= live or self.ledger.state[slot] == ST_FREE or generated < 0
                    or computed < 0 or computed > self.ledger.prompt[slot] + generated):
                self._check_update(slot, computed, generated)     # raises, naming the field
            row[3 * i], row[3 * i + 1], row[3 * i + 2] = slot, computed, generated
        cdef bint running_changed = False
        for i in range(n):
            self._queued_tokens += self.ledger.set_counts(<int32_t>row[3 * i], row[3 * i + 1], row[3 * i + 2])
            running_changed |= self.ledger.state[row[3 * i]] == ST_RUNNING
        if running_changed:
            self.policy.c_running_changed()

    def set_cached(self, int64_t slot, int64_t cached_tokens):
        """Prefix-cache hit the engine found for a waiting request (tokens)."""
        self.ledger.check_state(slot, ST_WAITING)
        if cached_tokens < 0 or cached_tokens > self.ledger.tokens(<int32_t>slot):
            raise ValueError(f"cached_tokens={cached_tokens}: must be in [0, {self.ledger.tokens(<int32_t>slot)}]")
        self._queued_tokens -= self.ledger.queued_of(<int32_t>slot)
        self.ledger.cached[slot] = cached_tokens
        self._queued_tokens += self.ledger.queued_of(<int32_t>slot)

    def set_blocks(self, int64_t slot, int64_t blocks):
        """KV blocks the engine holds for a request (for accounting and metrics)."""
        self.ledger.check_live(slot)
        if blocks < 0:
            raise ValueError(f"blocks={blocks}: must be >= 0")
        self.ledger.blocks[slot] = blocks

    def on_step(self, double now=0.0):
        """Once per engine step, after its preemptions: advances the predict ratio."""
        _check_now(now)
        self._advance(now)
        self.c_on_step()

    cdef void c_on_step(self) noexcept nogil:
        self.ledger.step += 1
        self.policy.c_on_step(self.ledger.running.empty() and self._waiting.empty())
        self._paused_now = 0

    def preempt(self, int64_t slot, double now=0.0):
        """Commits: a running request gives its memory back and waits again
        (recompute: its KV is gone, its output so far is kept)."""
        self.ledger.check_state(slot, ST_RUNNING)
        _check_now(now)
        self.c_preempt(<int32_t>slot, now)

    cdef void c_preempt(self, int32_t s, double now) noexcept nogil:
        """`preempt`, unchecked (the native engine's path too)."""
        self._note_time(now)
        self._preempt(s)

    cdef void _preempt(self, int32_t s) noexcept nogil:
        self._run_remove(s)
        self.ledger.computed[s] = 0
        self.ledger.cached[s] = 0
        self.ledger.blocks[s] = 0
        self.ledger.shared[s] = 0
        self.ledger.preempts[s] = self.ledger.preempts[s] + 1
        self._enqueue(s)
        self._n_preempted += 1
        self.policy.c_on_preempt()

    def finish(self, int64_t slot, double now=0.0):
        """A running request is done; its output length feeds the length model."""
        self.ledger.check_state(slot, ST_RUNNING)
        _check_now(now)
        self.c_finish(<int32_t>slot, now)

    cdef void c_finish(self, int32_t s, double now) noexcept nogil:
        """`finish`, unchecked (the native engine's path too)."""
        self._tick(now)
        self._finish(s)

    cdef void _finish(self, int32_t s) noexcept nogil:
        self._run_remove(s)
        self.policy.c_on_finish(s)
        self._n_len_obs += 1
        self._len_abs_err += llabs(self.ledger.pred_total[s] - self.ledger.generated[s])
        self._len_pred_sum += self.ledger.pred_total[s]
        self._len_actual_sum += self.ledger.generated[s]
        self._n_finished += 1
        self.ledger.release(s)

    def abort(self, int64_t slot, double now=0.0):
        """The request is gone (client cancelled, engine error): forget it."""
        self.ledger.check_live(slot)
        _check_now(now)
        self._note_time(now)
        cdef int32_t s = <int32_t>slot
        if self.ledger.state[s] == ST_RUNNING:
            self._run_remove(s)
        else:
            self._dequeue(s)
        self._n_aborted += 1
        self.ledger.release(s)

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
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={prompt_tokens}: must be >= 1")
        _check_now(now)
        cdef int64_t ahead, ahead_tokens
        # its place: behind every waiting request (the least priority, no deadline)
        self._ahead_of(self._order_key(INT64_MAX // 2, now, 0.0, 0.0, 0.0, self._seq),
                       &ahead, &ahead_tokens)
        cdef double delay = self._predicted_delay(ahead, ahead_tokens, prompt_tokens, now)
        return self.slo_guard.c_predict_ttft(ahead_tokens, prompt_tokens, delay, self.ledger.running.size(),
                                             self._running_context())

    def observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                      double now=0.0):
        """Once per engine step: KV blocks in use and the step's prefix-cache hit and
        query tokens. Every agent_interval_steps the agent window follows AIMD."""
        _check_now(now)
        self.c_observe_cache(used_blocks, hit_tokens, query_tokens, now)

    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                               double now) noexcept nogil:
        if not self.agent_window.enabled:
            return
        self._advance(now)
        self.agent_window.c_observe_cache(used_blocks, hit_tokens, query_tokens, self._last_now)

    def observe_used_blocks(self, int64_t used_blocks):
        """Once per engine step, after `update_many`: KV blocks in use (auto counts the
        prefixes running requests share once)."""
        if used_blocks < 0:
            raise ValueError(f"used_blocks={used_blocks}: must be >= 0")
        self.c_observe_used_blocks(used_blocks)

    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil:
        self.policy.c_observe_used_blocks(used_blocks)

    def set_shared(self, int64_t slot, int64_t shared_tokens):
        """At admission: prompt tokens of a request that sit in KV blocks other running
        requests already hold (prefix-cache hits on blocks in use). Only auto uses it."""
        self.ledger.check_live(slot)
        if shared_tokens < 0 or shared_tokens > self.ledger.tokens(<int32_t>slot):
            raise ValueError(f"shared_tokens={shared_tokens}: must be in [0, {self.ledger.tokens(<int32_t>slot)}]")
        self.c_set_shared(<int32_t>slot, shared_tokens)

    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil:
        self.policy.c_set_shared(s, shared_tokens)

    def next_session_expiry(self):
        """When the first active idle session leaves the agent window (inf: none).
        An engine with only window-held requests waiting can sleep until then."""
        return self.agent_window.c_next_expiry()

    def expire_sessions(self, double now):
        """Lets idle sessions leave the window as of `now` (engines call it when idle;
        observe_cache does it every step while the window is full)."""
        _check_now(now)
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
        """W after each of the recent AIMD updates (the last 4096 at least), oldest first."""
        return self.agent_window.history()

    # ------------------------------------------------------------------
    # Public API: victims
    def victim(self):
        """The running request to preempt first, or -1."""
        return self.c_victim()

    cdef int32_t c_victim(self) noexcept nogil:
        return victim_slot(self.ledger, self._victim)

    def victim_order(self):
        """Running slots from most protected to first victim (the last one goes first)."""
        return victim_order(self.ledger, self._victim)

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
        return self.ledger.running.size()

    @property
    def queued_tokens(self):
        return self._queued_tokens

    @property
    def new_token_ratio(self):
        """The predict policy's current ratio (SGLang's new_token_ratio)."""
        return self.policy.ratio

    @property
    def quantile(self):
        """The adaptive policy's current length quantile."""
        return self.policy.quantile

    @property
    def length_model(self):
        return self.policy.lengths

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
        return [s for s in self.ledger.running]

    def state(self, int64_t slot):
        if slot < 0 or slot >= <int64_t>self.ledger.state.size():
            return "free"
        return STATES[<int>self.ledger.state[slot]]

    def info(self, int64_t slot):
        """The ledger's numbers for one request."""
        self.ledger.check_live(slot)
        return {
            "state": self.state(slot), "prompt_tokens": self.ledger.prompt[slot],
            "cached_tokens": self.ledger.cached[slot], "computed_tokens": self.ledger.computed[slot],
            "generated_tokens": self.ledger.generated[slot], "max_new_tokens": self.ledger.max_new[slot],
            "priority": self.ledger.priority[slot], "arrival": self.ledger.arrival[slot],
            "arrival_time": self.ledger.engine_t[slot],
            "blocks": self.ledger.blocks[slot], "bypassed": self.ledger.bypassed[slot],
            "preemptions": self.ledger.preempts[slot],
        }

    def peak_blocks(self):
        """Peak blocks the running requests can reach under the policy's curves."""
        return self.policy.c_peak_blocks()

    @property
    def reserved_blocks(self):
        """Sum over running of blocks for prompt + max_new (the reserve policy's load)."""
        return self.ledger.reserve_sum

    def router_signals(self):
        """What a router in front of several engines can use (kvadmit knows it, their
        gauges do not): ``kv_headroom_blocks``, the blocks the policy could still admit
        without a forecast shortfall once the waiting requests' prompts are in;
        ``admission_pressure``, the forecast plus those prompts over the pool (above 1:
        more is queued than fits); ``predicted_queue_delay_s``, the wait of a request
        arriving now behind the queue at the recent admission rate (0 when none is
        known or nothing waits)."""
        cdef int64_t demand = self.policy.c_forecast_blocks() + cdiv(self._queued_tokens, self.block_size)
        return {
            "kv_headroom_blocks": max(self.num_blocks - demand, 0),
            "admission_pressure": demand / <double>self.num_blocks,
            "predicted_queue_delay_s": self.gate.c_peek_predicted_delay(
                self._waiting.size(), self._queued_tokens, 0, self._last_now,
                not self._waiting.empty()),
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
            "waiting": self._waiting.size(), "running": self.ledger.running.size(),
            "queued_tokens": self._queued_tokens,
            "new_token_ratio": self.policy.ratio, "quantile": self.policy.quantile,
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
