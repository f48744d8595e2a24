# The waiting queue: the queued slots in service order (arrival, priority or
# deadline; see QKey), the scan that finds the next one to admit (strict FIFO or
# bounded bypass), the holds it counts at the head, and the order in which
# priority shedding evicts never-admitted requests. It orders slots the ledger
# holds; the ledger's enqueue/dequeue keep their state and the queued sum, the
# core calls both.

from cython.operator cimport dereference as deref, preincrement as inc
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t
from libcpp.map cimport map as cmap
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._flows cimport FL_HELD, FlowTable
from kvadmit._ledger cimport Ledger

DECISIONS = ("admit", "hold_blocks", "hold_capacity", "hold_slo", "hold_agent", "hold_paused")

# head_of_line auto: a held request is passed by no later one once it has waited more
# than this many times the mean queue wait of recent first admissions. Bypass alone
# lets a large request be passed for as long as small ones fit (the online TTFT tail);
# a multiple of the waits the queue gives now bounds it on any time scale, and 2 keeps
# most of bypass's goodput (docs/policies.md#the-wait-bound).
cdef double AUTO_WAIT_BOUND = 2.0


cdef class Judge:
    """The decision a scan asks for (a subclass gives it: the core's)."""
    cdef int c_decide(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil:
        return D_ADMIT

    cdef bint c_may_displace(self, int32_t s) noexcept nogil:
        """Whether s may take KV from running requests (priority retraction), so that
        a pause of theirs does not hold it."""
        return False


cdef class WaitingQueue:
    """Queued slots in service order, over a ledger (the agent window's held
    sessions never block the queue)."""

    def __init__(self, config, Ledger ledger, AgentWindow agent_window, FlowTable flows):
        self.ledger = ledger
        self.agent_window = agent_window
        self.flows = flows
        self._fair = False
        self._priority_order = config.queue_order == "priority"
        self._deadline_order = config.queue_order == "deadline"
        self._bypass = config.bypass_head_of_line
        # shortfall "cost" resumes a preempted request once its blocks fit: none passes it
        self._resume_first = config.shortfall == "cost"
        self._max_bypass = config.max_bypass
        self._lookahead = config.bypass_lookahead
        if config.head_of_line == "auto" and self._bypass:
            self._max_bypass, self._lookahead = AUTO_MAX_BYPASS, AUTO_LOOKAHEAD
        self._max_wait_s = config.max_queue_delay_s
        # Not where a shortfall preempts (SGLang): there the bound cost up to 11% more
        # steps than stock SGLang on the retraction tests, past the accepted trade.
        self._learn_wait = (config.head_of_line == "auto" and self._bypass
                            and self._max_wait_s == 0 and config.pause_on_shortfall)
        self._wait_mean = 0.0
        self._waits = 0
        cdef int i
        for i in range(N_DECISIONS):
            self._held[i] = 0

    cdef void c_flows_on(self) noexcept nogil:
        """The first request with a flow arrived: from now on each flow's waiting
        requests are kept in queue order too (those waiting now: no flow)."""
        if self._fair:
            return
        self._fair = True
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        while it != self._waiting.end():
            self._by_flow[self.ledger.flow_ix(deref(it).second)][deref(it).first] = deref(it).second
            inc(it)

    cdef void _walk_begin(self) noexcept nogil:
        """Starts the fair walk: one cursor at each waiting flow's first request."""
        cdef cmap[int32_t, cmap[QKey, int32_t]].iterator f = self._by_flow.begin()
        cdef FlowCursor c
        self._cursors.clear()
        while f != self._by_flow.end():
            c.it = deref(f).second.begin()
            c.end = deref(f).second.end()
            c.tag = self.flows.c_vtime(deref(f).first)
            c.weight = self.flows.c_weight(deref(f).first)
            self._cursors.push_back(c)
            inc(f)

    cdef int32_t _walk_next(self) noexcept nogil:
        """The fair walk's next request (-1: none left): of the flows' next requests,
        the one of the most important key (its class, then priority under
        queue_order priority), among equal keys the one whose flow's usage per weight, with the
        blocks of its requests the walk has passed, is least (then queue order).
        Start-time fair queuing: each request's tag is its flow's usage plus the
        blocks of the flow's requests ahead of it, over the flow's weight."""
        cdef size_t i, best = 0, n = self._cursors.size()
        if n == 0:
            return -1
        cdef QKey kb, ki
        cdef int c
        for i in range(1, n):
            ki = deref(self._cursors[i].it).first
            kb = deref(self._cursors[best].it).first
            c = rank_cmp(ki, kb)
            if c != 0:
                if c < 0:
                    best = i
            elif self._cursors[i].tag != self._cursors[best].tag:
                if self._cursors[i].tag < self._cursors[best].tag:
                    best = i
            elif ki < kb:
                best = i
        cdef int32_t s = deref(self._cursors[best].it).second
        self._cursors[best].tag += self.ledger.held_blocks(s) / self._cursors[best].weight
        inc(self._cursors[best].it)
        if self._cursors[best].it == self._cursors[best].end:
            self._cursors[best] = self._cursors.back()
            self._cursors.pop_back()
        return s

    cdef void c_add(self, int32_t s) noexcept nogil:
        """The ledger-enqueued s takes its place (and in shedding's and expiry's order if never started)."""
        self._waiting[self.c_key(s)] = s
        self._n_sheddable += self.ledger.sheddable(s)
        if self._fair:
            self._by_flow[self.ledger.flow_ix(s)][self.c_key(s)] = s
        if self.ledger.unstarted(s):
            self._shed_order[self._shed_key(s)] = s
            if self.ledger.expire_at(s) < INFINITY:
                self._expiry[self._expiry_key(s)] = s

    cdef void c_remove(self, int32_t s) noexcept nogil:
        """s leaves the queue (before the ledger's dequeue clears its unstarted mark)."""
        self._waiting.erase(self.c_key(s))
        self._n_sheddable -= self.ledger.sheddable(s)
        cdef cmap[int32_t, cmap[QKey, int32_t]].iterator f
        if self._fair:
            f = self._by_flow.find(self.ledger.flow_ix(s))
            deref(f).second.erase(self.c_key(s))
            if deref(f).second.empty():
                self._by_flow.erase(f)
        if self.ledger.unstarted(s):
            self._shed_order.erase(self._shed_key(s))
            self._expiry.erase(self._expiry_key(s))

    cdef void c_ahead_of(self, QKey key, int64_t* reqs, int64_t* tokens) noexcept nogil:
        """Waiting requests (and their prefill tokens) that the queue order serves
        before a request with this key: all of them in arrival order (a new arrival
        is last), else a walk to its position (skipping requests held outside the
        agent window: they do not block it, and sheddable ones behind it)."""
        if not self._priority_order and not self._deadline_order and not self.agent_window.enabled \
                and self._n_sheddable == 0:
            reqs[0] = self._waiting.size()
            tokens[0] = self.ledger.queued_tokens()
            return
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        reqs[0] = tokens[0] = 0
        while it != self._waiting.end() and deref(it).first < key:
            if not self._agent_held(deref(it).second):   # held ones do not block it
                reqs[0] += 1
                tokens[0] += self.ledger.queued_of(deref(it).second)
            inc(it)

    cdef void c_ahead_of_slot(self, int32_t s, int64_t* reqs, int64_t* tokens) noexcept nogil:
        """c_ahead_of for the not yet queued s: under the fair walk (flows waiting
        other than its own), the requests the walk would serve before it: those of a
        more important order key, or of the same one with a smaller tag (its flow's
        usage per weight plus the blocks of its flow's requests ahead of it)."""
        cdef int32_t f = self.ledger.flow_ix(s)
        cdef QKey key = self.c_key(s)
        if not self._fair or self._by_flow.empty() or \
                (self._by_flow.size() == 1 and deref(self._by_flow.begin()).first == f):
            self.c_ahead_of(key, reqs, tokens)
            return
        cdef double tag = self.flows.c_vtime(f), t
        cdef cmap[int32_t, cmap[QKey, int32_t]].iterator g = self._by_flow.find(f)
        cdef cmap[QKey, int32_t].iterator it
        cdef int32_t r
        cdef int c
        if g != self._by_flow.end():
            it = deref(g).second.begin()
            while it != deref(g).second.end() and deref(it).first < key:
                tag += self.ledger.held_blocks(deref(it).second) / self.flows.c_weight(f)
                inc(it)
        reqs[0] = tokens[0] = 0
        g = self._by_flow.begin()
        while g != self._by_flow.end():
            t = self.flows.c_vtime(deref(g).first)
            it = deref(g).second.begin()
            while it != deref(g).second.end():
                r = deref(it).second
                c = rank_cmp(deref(it).first, key)
                if c > 0 or (c == 0 and (t > tag or (t == tag and not (deref(it).first < key)))):
                    break                      # this flow's later ones come after s too
                if not self._agent_held(r):
                    reqs[0] += 1
                    tokens[0] += self.ledger.queued_of(r)
                t += self.ledger.held_blocks(r) / self.flows.c_weight(deref(g).first)
                inc(it)
            inc(g)

    cdef void c_admitted(self, int32_t s, double now) noexcept nogil:
        """s is admitted at `now` (before the ledger starts it): a first admission's
        queue wait feeds the learned wait bound (an admission the engine undid and
        made again counts once, by its first wait), and each request ahead of s
        (not held outside the agent window) counts a bypass."""
        if self._learn_wait and self.ledger.unstarted(s):
            self._waits += 1
            self._wait_mean += (now - self.ledger.arrive_t(s) - self._wait_mean) \
                / min(self._waits, <int64_t>WAIT_WINDOW)
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        cdef int32_t passed
        if self._walking():
            self._walk_begin()
            passed = self._walk_next()
            while passed != s and passed >= 0:
                if not self._agent_held(passed):
                    self.ledger.bypass(passed)
                passed = self._walk_next()
            return
        while deref(it).second != s:
            passed = deref(it).second
            if not self._agent_held(passed):
                self.ledger.bypass(passed)
            inc(it)

    cdef double c_wait_bound(self) noexcept nogil:
        """Seconds of waiting after which a held request is passed by none (INFINITY:
        no bound, or no bypass): max_queue_delay_s, else under head_of_line auto
        AUTO_WAIT_BOUND times the mean wait of recent first admissions (once there
        was one). A preempted request's wait counts from its arrival: back in the
        queue it is passed by none (vLLM, too, resumes preempted requests first)."""
        if not self._bypass:
            return INFINITY
        if self._max_wait_s > 0:
            return self._max_wait_s
        if self._learn_wait and self._waits > 0:
            return AUTO_WAIT_BOUND * self._wait_mean
        return INFINITY

    cdef bint _waited_out(self, double waited, double bound) noexcept nogil:
        """Whether `waited` seconds reach c_wait_bound: max_queue_delay_s holds a
        request that has waited it, the learned bound one that has waited more (at
        the start of a burst, when the admissions so far waited 0 s, a request held
        on arrival is still passed in that step)."""
        return waited >= bound if self._max_wait_s > 0 else waited > bound

    @property
    def wait_bound_s(self):
        """c_wait_bound in seconds, None where there is none."""
        cdef double b = self.c_wait_bound()
        return None if b == INFINITY else b

    cdef int32_t c_scan(self, Judge judge, int64_t free_blocks, bint check_blocks,
                        bint paused, double now) noexcept nogil:
        """The first waiting request that may start now, in queue order with bypass
        (-1: none); counts the head's hold. `paused`: running requests are paused
        this step, and they have the first claim on blocks as they free up. A held
        request that has waited out c_wait_bound at `now` is passed by no later one
        (bypass alone lets a large request be passed for as long as small ones
        fit). A sheddable request is not reached once one that is not has been held
        (they come after all others): the scan notes the saturation (c_saturated)."""
        self._saturated = False
        if self._waiting.empty():
            return -1
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        cdef int32_t s
        cdef int d
        cdef bint head = True
        cdef int64_t scanned = 0
        cdef bint walk = self._walking()
        # the fair walk: the least and second-least holding (blocks per weight) among
        # the flows of the held requests passed so far, and the least one's flow
        cdef double bar1 = INFINITY, bar2 = INFINITY, mine
        cdef int32_t bar1_flow = -1, f
        cdef double bound = self.c_wait_bound()
        cdef int64_t peers_of = -1      # the arrival step of the held requests that waited out
        if walk:
            self._walk_begin()
        while True:
            if walk:
                s = self._walk_next()
                if s < 0:
                    break
                f = self.ledger.flow_ix(s)
                mine = self.flows.c_holding(f)
                if mine > (bar2 if f == bar1_flow else bar1):
                    # it would pass a held request of a flow holding less: skipped
                    head = False
                    scanned += 1
                    if scanned >= self._lookahead:
                        return -1
                    continue
            elif it == self._waiting.end():
                break
            else:
                s = deref(it).second
            if self._saturated and self.ledger.sheddable(s):
                return -1
            if peers_of >= 0 and self.ledger.arrive_step(s) != peers_of:
                return -1
            # Paused running requests have the first claim on blocks as they free up,
            # except against a request that may take their KV (priority retraction).
            if paused and not judge.c_may_displace(s):
                if head:
                    self._count_hold(s, D_HOLD_PAUSED)
                self._saturated = self._saturated or not self.ledger.sheddable(s)
                return -1
            d = judge.c_decide(s, free_blocks, check_blocks)
            if d == D_ADMIT:
                return s
            if head:
                self._count_hold(s, d)
            if d != D_HOLD_AGENT and not self.ledger.sheddable(s):
                self._saturated = True
            # A request outside the agent window never blocks the queue; any other
            # held request does, unless bypass lets later ones pass it (under shortfall
            # "cost" not one that ran before: preempted, its stream stalled).
            if d != D_HOLD_AGENT:
                if not self._bypass or self.ledger.bypassed(s) >= self._max_bypass \
                        or (self._resume_first and self.ledger.preempts(s) > 0):
                    return -1
                if self._waited_out(now - self.ledger.arrive_t(s), bound):
                    # passed by none that arrived later; under the learned bound its
                    # peers (arrived in the same step: a burst) still pass it, and
                    # only they are reached from here (checked above)
                    if not self._learn_wait:
                        return -1
                    peers_of = self.ledger.arrive_step(s)
                if not head:
                    scanned += 1
                    if scanned >= self._lookahead:
                        return -1
                if walk:
                    if f == bar1_flow:
                        pass
                    elif mine < bar1:
                        bar2, bar1, bar1_flow = bar1, mine, f
                    elif mine < bar2:
                        bar2 = mine
            head = False
            if not walk:
                inc(it)
        return -1

    cdef void _count_hold(self, int32_t s, int d) noexcept nogil:
        """Counts a hold once per request and step: held_total means (request, step)
        pairs in which the request at the head of the queue could not start."""
        if self.ledger.note_held(s):
            self._held[d] += 1
            if self._fair:
                self.flows.c_count(self.ledger.flow_ix(s), FL_HELD)

    cdef void c_pick_expired(self, double now, vector[int32_t]* picked) noexcept nogil:
        """The never-started waiting requests whose TTL has run out at `now`, the
        earliest expiry first (into `picked`)."""
        cdef cmap[QKey, int32_t].iterator it = self._expiry.begin()
        picked.clear()
        while it != self._expiry.end() and deref(it).first.time <= now:
            picked.push_back(deref(it).second)
            inc(it)

    cdef bint c_pick_shed(self, int32_t s, bint sheddable_only, int64_t over_reqs,
                          int64_t over_tokens, vector[int32_t]* picked) noexcept nogil:
        """The never-admitted waiting requests less important than the arrival s
        (`sheddable_only`: the sheddable ones) whose eviction makes room for it (least
        important first, into `picked`); False, picking none, if evicting them all is
        not enough."""
        cdef cmap[QKey, int32_t].reverse_iterator it = self._shed_order.rbegin()
        cdef int64_t reqs = over_reqs, toks = over_tokens
        cdef int32_t v
        picked.clear()
        while (reqs > 0 or toks > 0) and it != self._shed_order.rend():
            v = deref(it).second
            if not self.ledger.ranks_below(v, s, 0) or \
                    (sheddable_only and not self.ledger.sheddable(v)):
                break
            picked.push_back(v)
            reqs -= 1
            toks -= self.ledger.queued_of(v)
            inc(it)
        if reqs > 0 or toks > 0:
            picked.clear()
            return False
        return True

    cdef void c_pick_sheddable(self, vector[int32_t]* picked) noexcept nogil:
        """Every never-admitted sheddable waiting request (least important first)."""
        cdef cmap[QKey, int32_t].reverse_iterator it = self._shed_order.rbegin()
        picked.clear()
        while it != self._shed_order.rend() and self.ledger.sheddable(deref(it).second):
            picked.push_back(deref(it).second)
            inc(it)

    def slots(self):
        """Waiting slots in service order (the fair walk's while two flows wait)."""
        cdef list out = []
        cdef cmap[QKey, int32_t].iterator it = self._waiting.begin()
        cdef int32_t s
        if self._walking():
            self._walk_begin()
            s = self._walk_next()
            while s >= 0:
                out.append(s)
                s = self._walk_next()
            return out
        while it != self._waiting.end():
            out.append(deref(it).second)
            inc(it)
        return out

    def held(self):
        """(request, step) pairs held at the head, by reason."""
        return {DECISIONS[i]: self._held[i] for i in range(1, N_DECISIONS)}
