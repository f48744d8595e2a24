# The request ledger: every request's numbers, in native arrays indexed by a
# slot, the running set and the sums over it and over the queued requests. Slots
# are reused after release. Every change of a request's state is one transition
# here, which keeps the sums in step:
#   add            a new arrival's numbers (waiting, not yet queued: the core may refuse it)
#   enqueue        it waits in the queue (queued tokens +)
#   dequeue        it leaves the queue, to start or to be released (queued tokens -)
#   start          it runs (running set, reserve load, running context +)
#   stop           it leaves the running set (reserve load, running context -)
#   preempt        stop, its KV gone, enqueue again
#   cancel_start   stop, enqueue again (the engine did not run it)
#   finish         stop, its output length into the length-error stats
#   release        the slot is free
# The queue's order is kvadmit._waiting_queue's; the core calls both.

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport llabs
from libcpp.vector cimport vector

STATES = ("free", "waiting", "running")


cdef class Ledger:
    """Requests by slot (see the .pxd for the arrays)."""

    def __init__(self, int64_t block_size, int64_t prefill_chunk):
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self._step = self._seq = 0
        self._reserve_sum = self._run_ctx = self._queued = 0
        self._n_len_obs = 0
        self.add_flow()      # index 0: requests without a flow
        self._len_abs_err = self._len_pred_sum = self._len_actual_sum = 0.0

    cdef int32_t add(self, const ArrivalRecord* r, double ttft, double tpot, double arrive_t,
                     int64_t session, double expire_at, int32_t flow_ix):
        """A slot holding an arrival's record, the next in arrival order, not yet
        queued (its state is waiting so the policies may read it); ``ttft`` /
        ``tpot`` its targets, ``session`` its session and ``expire_at`` when it is
        dropped unstarted, as the core resolved them; ``flow_ix`` its flow's index
        (0: no flow; see kvadmit._flows)."""
        cdef int32_t s
        if not self._free_slots.empty():
            s = self._free_slots.back()
            self._free_slots.pop_back()
        else:
            s = <int32_t>self._prompt.size()
            self._prompt.push_back(0); self._cached.push_back(0); self._computed.push_back(0)
            self._generated.push_back(0); self._max_new.push_back(0); self._priority.push_back(0)
            self._arrival.push_back(0); self._admit_seq.push_back(-1); self._admit_step.push_back(-1)
            self._held_step.push_back(-1); self._arrive_step.push_back(-1)
            self._blocks.push_back(0); self._pred_total.push_back(0); self._shared.push_back(0)
            self._bypassed.push_back(0); self._preempts.push_back(0); self._run_pos.push_back(-1)
            self._state.push_back(ST_FREE); self._unstarted.push_back(0); self._sheddable.push_back(0)
            self._ttft.push_back(0.0); self._tpot.push_back(0.0); self._arrive_t.push_back(0.0)
            self._engine_t.push_back(0.0); self._engine_tie.push_back(0.0)
            self._expire_at.push_back(0.0)
            self._rec.push_back(r[0])
            self._session.push_back(-1); self._activated_by.push_back(0)
            self._flow.push_back(-1); self._flow_ix.push_back(0)
        self._prompt[s] = r.prompt_tokens
        self._cached[s] = r.cached_tokens
        self._computed[s] = self._generated[s] = 0
        self._max_new[s] = r.max_new_tokens
        self._priority[s] = r.priority
        self._sheddable[s] = r.sheddable
        self._arrival[s] = self._seq
        self._seq += 1
        self._admit_seq[s] = self._admit_step[s] = self._held_step[s] = -1
        self._arrive_step[s] = self._step
        self._blocks[s] = self._shared[s] = self._pred_total[s] = 0
        self._bypassed[s] = self._preempts[s] = 0
        self._ttft[s] = ttft
        self._tpot[s] = tpot
        self._arrive_t[s] = arrive_t
        self._engine_t[s] = r.arrival_time
        self._engine_tie[s] = r.arrival_tie
        self._expire_at[s] = expire_at
        self._rec[s] = r[0]
        self._session[s] = session
        self._flow[s] = r.flow
        self._flow_ix[s] = flow_ix
        self._f_live[flow_ix] += 1
        self._state[s] = ST_WAITING  # provisional, so the policies may read it
        return s

    cdef void enqueue(self, int32_t s, bint unstarted) noexcept nogil:
        """s waits in the queue (`unstarted`: it was never admitted, so shedding and
        its TTL may drop it)."""
        self._state[s] = ST_WAITING
        self._queued += self.queued_of(s)
        self._unstarted[s] = unstarted
        self._f_waiting[self._flow_ix[s]] += 1
        self._f_queued[self._flow_ix[s]] += self.queued_of(s)

    cdef void dequeue(self, int32_t s) noexcept nogil:
        """s leaves the queue (to start, or to be released)."""
        self._queued -= self.queued_of(s)
        self._unstarted[s] = 0
        self._f_waiting[self._flow_ix[s]] -= 1
        self._f_queued[self._flow_ix[s]] -= self.queued_of(s)

    cdef void start(self, int32_t s, bint activated) noexcept nogil:
        """The dequeued s starts running (`activated`: its admission activated its
        agent session); it is the next in the one arrival-and-admission sequence."""
        self._activated_by[s] = activated
        self._admit_seq[s] = self._seq
        self._seq += 1
        self._admit_step[s] = self._step
        self._state[s] = ST_RUNNING
        self._run_pos[s] = <int32_t>self._running.size()
        self._running.push_back(s)
        self._reserve_sum += self.reserve_blocks(s)
        self._run_ctx += self.tokens(s)

    cdef void stop(self, int32_t s) noexcept nogil:
        """Takes the running s out of the running set (the caller's next transition
        sets its state: enqueue, finish, release)."""
        cdef int32_t pos = self._run_pos[s]
        cdef int32_t last = self._running.back()
        self._running[pos] = last
        self._run_pos[last] = pos
        self._running.pop_back()
        self._run_pos[s] = -1
        self._reserve_sum -= self.reserve_blocks(s)
        self._run_ctx -= self.tokens(s)

    cdef void preempt(self, int32_t s) noexcept nogil:
        """The running s gives its KV back and is queued again (recompute: its
        output so far is kept)."""
        self.stop(s)
        self._computed[s] = self._cached[s] = self._blocks[s] = self._shared[s] = 0
        self._preempts[s] += 1
        self.enqueue(s, False)

    cdef bint cancel_start(self, int32_t s) noexcept nogil:
        """Undoes the start of s (the engine did not run it): queued again, sharing
        nothing. Returns whether that admission had activated its session."""
        cdef bint activated = self._activated_by[s]
        self.stop(s)
        self._shared[s] = 0
        self._activated_by[s] = 0
        self.enqueue(s, False)
        return activated

    cdef void finish(self, int32_t s) noexcept nogil:
        """The running s is done: out of the running set; its output length against
        the prediction goes into the length-error stats (release it next)."""
        self.stop(s)
        self._n_len_obs += 1
        self._len_abs_err += llabs(self._pred_total[s] - self._generated[s])
        self._len_pred_sum += self._pred_total[s]
        self._len_actual_sum += self._generated[s]

    cdef void release(self, int32_t s) noexcept nogil:
        """The slot is free again (s is neither queued nor running)."""
        self._state[s] = ST_FREE
        self._free_slots.push_back(s)
        self._f_live[self._flow_ix[s]] -= 1

    cdef void set_cached(self, int32_t s, int64_t cached_tokens) noexcept nogil:
        """The prefix-cache hit of the queued s (tokens)."""
        cdef int64_t before = self.queued_of(s)
        self._cached[s] = cached_tokens
        self._queued += self.queued_of(s) - before
        self._f_queued[self._flow_ix[s]] += self.queued_of(s) - before

    cdef int check_state(self, int64_t s, int want) except -1:
        """A live slot in state `want` (ST_WAITING or ST_RUNNING)."""
        self.check_live(s)
        if self._state[s] != want:
            raise ValueError(
                f"slot {s} is {STATES[<int>self._state[s]]}, "
                f"expected {STATES[want]}")
        return 0

    cdef int check_counts(self, int64_t s, int64_t computed, int64_t generated) except -1:
        """An engine's counts for the live slot s, or ValueError naming the field."""
        self.check_live(s)
        if generated < 0:
            raise ValueError(f"generated_tokens={generated}: must be >= 0")
        if computed < 0 or computed > self._prompt[s] + generated:
            raise ValueError(f"computed_tokens={computed}: must be in "
                             f"[0, prompt_tokens + generated_tokens = {self._prompt[s] + generated}]")
        return 0

    cdef Py_ssize_t check_rows(self, slots, computed_tokens, generated_tokens,
                               str caller) except -1:
        """Reads and checks an engine's counts for many slots, (slot, computed,
        generated) rows (`rows()`, kept between calls: no allocation a step); how many.
        A bad entry raises ValueError (naming the field) before any is applied."""
        cdef Py_ssize_t i, n = len(slots)
        if len(computed_tokens) != n or len(generated_tokens) != n:
            raise ValueError(f"{caller}: {n} slots but {len(computed_tokens)} computed_tokens "
                             f"and {len(generated_tokens)} generated_tokens")
        if <Py_ssize_t>self._rows.size() < 3 * n:
            self._rows.resize(3 * n)
        cdef int64_t* row = self._rows.data()
        cdef int64_t slot, computed, generated, live = self._state.size()
        for i in range(n):
            slot, computed, generated = slots[i], computed_tokens[i], generated_tokens[i]
            if (slot < 0 or slot >= live or self._state[slot] == ST_FREE or generated < 0
                    or computed < 0 or computed > self._prompt[slot] + generated):
                self.check_counts(slot, computed, generated)     # raises, naming the field
            row[3 * i], row[3 * i + 1], row[3 * i + 2] = slot, computed, generated
        return n

    cdef bint apply_rows(self, const int64_t* rows, Py_ssize_t n) noexcept nogil:
        """`set_counts` for n (slot, computed, generated) rows of live slots. Returns
        whether a running request's counts were among them."""
        cdef Py_ssize_t i
        cdef bint running_changed = False
        for i in range(n):
            self.set_counts(<int32_t>rows[3 * i], rows[3 * i + 1], rows[3 * i + 2])
            running_changed |= self._state[rows[3 * i]] == ST_RUNNING
        return running_changed

    cdef bint update_many(self, slots, computed_tokens, generated_tokens) except -1:
        """`set_counts` for many slots at once: every entry is checked before any is
        applied, so a refused call changes nothing. Returns whether a running
        request's counts were among them."""
        cdef Py_ssize_t n = self.check_rows(slots, computed_tokens, generated_tokens, "update_many")
        return self.apply_rows(self._rows.data(), n)

    def info(self, int64_t slot):
        """The numbers of one live request."""
        self.check_live(slot)
        return {
            "state": STATES[<int>self._state[slot]], "prompt_tokens": self._prompt[slot],
            "cached_tokens": self._cached[slot], "computed_tokens": self._computed[slot],
            "generated_tokens": self._generated[slot], "max_new_tokens": self._max_new[slot],
            "priority": self._priority[slot], "sheddable": bool(self._sheddable[slot]), "arrival": self._arrival[slot],
            "arrival_time": self._engine_t[slot], "arrival_tie": self._engine_tie[slot],
            "session": self._session[slot], "flow": self._flow[slot], "ttft_target_s": self._ttft[slot],
            "tpot_target_s": self._tpot[slot], "expire_at": self._expire_at[slot],
            "blocks": self._blocks[slot], "bypassed": self._bypassed[slot],
            "preemptions": self._preempts[slot],
        }

    def length_predictions(self):
        """Finished requests' predicted against actual output lengths."""
        cdef int64_t n = self._n_len_obs
        return {
            "finished": n,
            "mean_predicted": self._len_pred_sum / n if n else 0.0,
            "mean_actual": self._len_actual_sum / n if n else 0.0,
            "mean_abs_error": self._len_abs_err / n if n else 0.0,
        }
