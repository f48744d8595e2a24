# Flows with a fair share of the KV pool.
#
# A flow is a tenant or a workload (GIE's x-gateway-inference-fairness-id, the
# request field `flow`, a workload's flow column). Among waiting requests of the same
# priority (the queue's order key), the queue serves first the flow whose KV usage
# per unit of weight is least (kvadmit._waiting_queue's fair walk): start-time fair
# queuing over block-steps.
#
# The cost unit is the block-step: each engine step, a running request costs its flow
# the KV blocks its tokens fill (the step it is admitted in, at admission). KV is what
# is scarce, and a block held for a step is a block no other request holds in it:
# block-steps count occupancy, where a request count would make a 30k-token prompt
# cost what a 100-token one does. Steps rather than seconds: every request in a batch
# holds its blocks for the same step, whatever the step's length, and the order then
# does not depend on the engine's clock (a replay, a test with injected times, the
# simulator all order alike). The block-seconds are counted too, for the KV share
# each flow got (flow_stats).
#
# A flow that becomes live (from no request waiting or running) starts at the least
# normalised usage among the other live flows, if that is above its own: a flow that
# was idle has no credit to spend (it cannot starve the others), and none it must
# first pay back (it is not starved for having been idle). The order only ever
# reorders the queue: the scan's rules (holds, bypass, caps) are the same, so the
# sharing is work-conserving and a flow alone gets everything. One rule more, under
# head_of_line bypass: a later request passes a held one of another flow only if its
# own flow holds no more of the pool (blocks per weight, now) than the held one's,
# so that a bypass never moves KV from the flow holding less to the one holding more
# (a noisy neighbour's small requests would otherwise take, one by one, the blocks a
# quiet flow's request waits for).
#
# The order alone cannot help a quiet flow whose request arrives while a noisy one's
# running requests fill the pool: it would wait for them to finish. Its request may
# take their KV instead (flow displacement, kvadmit._decision): a flow's share is the
# pool times its weight over the live flows' weights (c_share, c_over_share), and a
# request of a flow within its share may start on the KV of running requests of a
# flow over it. Until the first request with a flow arrives, nothing here runs and
# the queue is the plain one.

from cython.operator cimport dereference as deref
from libc.stdint cimport int32_t, int64_t

from kvadmit._ledger cimport Ledger



cdef class FlowTable:
    """The flows' weights, caps, usage and counters, by flow index (0: no flow)."""

    def __init__(self, config, Ledger ledger, int64_t num_blocks=0):
        from kvadmit.request_fields import flow_int
        self.ledger = ledger
        self.num_blocks = num_blocks
        self.on = False
        self._default_weight = config.flow_default_weight
        self._configured = {}
        for key, spec in config.flows.items():
            self._configured[flow_int(key, f"flows[{key!r}]")] = (key, spec)
        self._last_t = 0.0
        self._stepped = False
        self._add(-1, self._default_weight, 0, 0)       # index 0: requests without a flow

    cdef void _add(self, int64_t flow, double weight, int64_t cap_reqs, int64_t cap_tokens):
        cdef int i
        self._id.push_back(flow)
        self._weight.push_back(weight)
        self._cap_reqs.push_back(cap_reqs)
        self._cap_tokens.push_back(cap_tokens)
        self._vtime.push_back(0.0)
        self._block_steps.push_back(0.0)
        self._block_s.push_back(0.0)
        self._holding.push_back(0)
        self._now.push_back(0)
        for i in range(N_FLOW_COUNTERS):
            self._counts.push_back(0)
        if self._id.size() > <size_t>self.ledger.n_flows():
            self.ledger.add_flow()

    cdef int32_t c_index(self, int64_t flow) except -1:
        """The index of flow id `flow` (>= 0), new ones numbered as they first arrive,
        with their configured weight and caps (else the default weight, no caps).
        The first one turns the fair order on."""
        self.on = True
        cdef unordered_map[int64_t, int32_t].iterator it = self._ix.find(flow)
        if it != self._ix.end():
            return deref(it).second
        cdef int32_t f = <int32_t>self._id.size()
        key_spec = self._configured.get(flow)
        spec = key_spec[1] if key_spec is not None else {}
        self._add(flow, spec.get("weight", self._default_weight),
                  spec.get("max_queued_requests", 0), spec.get("max_queued_tokens", 0))
        self._ix[flow] = f
        return f

    cdef void c_activate(self, int32_t f) noexcept nogil:
        """Flow f just became live: it starts no lower than the least normalised usage
        of the other live flows (start-time fair queuing's virtual time)."""
        cdef size_t g
        cdef bint any_live = False
        cdef double least = 0.0
        for g in range(self._id.size()):
            if <int32_t>g != f and self.ledger.flow_live(<int32_t>g) > 0:
                if not any_live or self._vtime[g] < least:
                    least = self._vtime[g]
                any_live = True
        if any_live and least > self._vtime[f]:
            self._vtime[f] = least

    cdef void c_charge(self, int32_t s, int sign=1) noexcept nogil:
        """The just-admitted s costs its flow its blocks for the step it starts in
        (sign -1: its admission is undone, before it ran)."""
        cdef int32_t f = self.ledger.flow_ix(s)
        cdef int64_t b = sign * self.ledger.held_blocks(s)
        self._vtime[f] += b / self._weight[f]
        self._block_steps[f] += b
        self._holding[f] += b
        self._now[f] += b
        self._counts[N_FLOW_COUNTERS * f + FL_ADMITTED] += sign

    cdef void c_accrue(self, double now) noexcept nogil:
        """Once per engine step (before the ledger's step count moves on): each running
        request costs its flow its blocks for this step (the ones admitted in it were
        charged at admission); the block-seconds since the last step go to the blocks
        each flow held then."""
        cdef size_t i, n = self._id.size()
        cdef int32_t s, f
        cdef int64_t b
        cdef double dt = now - self._last_t if self._stepped and now > self._last_t else 0.0
        for i in range(n):
            self._block_s[i] += self._holding[i] * dt
            self._holding[i] = 0
            self._now[i] = 0
        for i in range(<size_t>self.ledger.n_running()):
            s = self.ledger.running_at(i)
            f = self.ledger.flow_ix(s)
            b = self.ledger.held_blocks(s)
            self._holding[f] += b
            self._now[f] += b
            if self.ledger.admit_step(s) != self.ledger.step():
                self._vtime[f] += b / self._weight[f]
                self._block_steps[f] += b
        if now > self._last_t or not self._stepped:
            self._last_t = now
        self._stepped = True

    cdef void c_released(self, int32_t s) noexcept nogil:
        """The running s leaves the running set (preempted, finished, aborted) before
        the next step: its blocks no longer count to its flow's holding now."""
        cdef int32_t f = self.ledger.flow_ix(s)
        self._now[f] -= self.ledger.held_blocks(s)
        if self._now[f] < 0:
            self._now[f] = 0

    cdef double c_live_weight(self, int32_t f) noexcept nogil:
        """The weights of the live flows, f counted live (-1: none besides)."""
        cdef size_t g
        cdef double total = 0.0
        for g in range(self._id.size()):
            if self.ledger.flow_live(<int32_t>g) > 0 or <int32_t>g == f:
                total += self._weight[g]
        return total

    cdef double c_share(self, int32_t f) noexcept nogil:
        """Flow f's weighted share of the pool, in blocks, among the live flows (f
        counted live: its request is the one being judged)."""
        return self.num_blocks * self._weight[f] / self.c_live_weight(f)

    cdef void c_over_share(self, vector[char]& over) noexcept nogil:
        """Per flow index: 1 if the flow is over its share: it holds more blocks than
        its weighted share of the pool among the live flows (now: as of the last step,
        plus admissions since, less what was preempted or finished since), and it has used no less per weight over time (vtime) than
        some live flow that holds no more than its own share. A flow over its share
        only for a burst, having used less than the flows it outholds, is not."""
        cdef size_t g, h, n = self._id.size()
        cdef double live_weight = self.c_live_weight(-1)
        cdef vector[char] above                  # holds more than its share now
        over.assign(n, 0)
        above.assign(n, 0)
        if live_weight <= 0.0:
            return
        for g in range(n):
            above[g] = self.ledger.flow_live(<int32_t>g) > 0 \
                and self._now[g] > self.num_blocks * self._weight[g] / live_weight
        for g in range(n):
            if not above[g]:
                continue
            for h in range(n):
                if h != g and self.ledger.flow_live(<int32_t>h) > 0 and not above[h] \
                        and self._vtime[g] >= self._vtime[h]:
                    over[g] = 1
                    break

    cdef str c_name(self, int32_t f):
        """How messages and stats name flow f: its key in the config's flows, else its id."""
        if f == 0:
            return "none"
        key_spec = self._configured.get(self._id[f])
        return repr(key_spec[0]) if key_spec is not None else str(self._id[f])

    def stats(self):
        """Per flow (by its name; None: requests without a flow): weight, counters, its
        requests waiting and running now, and its KV usage (block-steps, block-seconds
        and its share of all flows' block-seconds; of block-steps when no time passed)."""
        cdef size_t i, n = self._id.size()
        cdef double total_s = 0.0, total_steps = 0.0
        cdef dict out = {}
        if not self.on:
            return out
        running = [0] * n
        for i in range(<size_t>self.ledger.n_running()):
            running[self.ledger.flow_ix(self.ledger.running_at(i))] += 1
        for i in range(n):
            total_s += self._block_s[i]
            total_steps += self._block_steps[i]
        for i in range(n):
            if i == 0 and self._block_steps[0] == 0 and self.ledger.flow_live(0) == 0 \
                    and self._counts[FL_REFUSED] == 0 and self._counts[FL_ADMITTED] == 0:
                continue      # no request without a flow ever seen
            key_spec = self._configured.get(self._id[i])
            name = None if i == 0 else (key_spec[0] if key_spec is not None else str(self._id[i]))
            c = N_FLOW_COUNTERS * i
            out[name] = {
                "flow": self._id[i], "weight": self._weight[i],
                "admitted": self._counts[c + FL_ADMITTED], "held": self._counts[c + FL_HELD],
                "refused": self._counts[c + FL_REFUSED], "preempted": self._counts[c + FL_PREEMPTED],
                "waiting": self.ledger.flow_waiting(<int32_t>i), "running": running[i],
                "queued_tokens": self.ledger.flow_queued(<int32_t>i),
                "kv_block_steps": self._block_steps[i], "kv_block_seconds": self._block_s[i],
                "kv_share": (self._block_s[i] / total_s if total_s > 0 else
                             self._block_steps[i] / total_steps if total_steps > 0 else 0.0),
                "usage_per_weight": self._vtime[i],
            }
        return out


