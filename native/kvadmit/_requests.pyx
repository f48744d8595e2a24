# Requests: a workload's requests as columns, every entry checked when built
# (ValueError naming column[row] and its limit), so whoever takes them (the native
# engine's add_requests, a fleet's engines) reads C arrays it can trust. Each row's
# core numbers are one arrival record (kvadmit._arrival).

from libc.math cimport isfinite

from kvadmit._arrival cimport check_record

from kvadmit._arrival import COLUMNS, DEFAULTS


cdef _column(str name, values, Py_ssize_t n):
    if values is not None and len(values) != n:
        raise ValueError(f"{name}: {len(values)} entries, expected {n} (one per request)")
    return values


cdef class Requests:
    """Requests in columns (sequences of one entry each; None: the default).

    ``arrival_s``: fixed arrival times, not decreasing (a row with ``parent`` >= 0
    is instead the next turn of that earlier request, counted over every request
    the engine was given, arriving ``delay_s`` after it ended; its arrival_s is
    ignored). ``prompt_tokens``, ``max_new_tokens`` and ``output_tokens`` (its real
    length, at most max_new_tokens); ``priority`` (0), ``ttft_slo_s`` /
    ``tpot_slo_s`` (-1: the config's defaults), ``session`` (-1: none), ``ttl_s``
    (-1: the config's max_queue_age_s; 0: none), ``flow`` (-1: none), ``sheddable`` (false),
    ``prompt_hash`` (0: unknown; a retry repeats its request's), and any other column of
    the arrival record (kvadmit._arrival.COLUMNS, its default DEFAULTS): the arrival
    record the core gets. ``hash_offsets`` (n + 1) and ``hash_ids``: each row's
    prefix-block ids in CSR form, describing its first ``hashed_tokens`` tokens
    (default: the prompt)."""

    def __init__(self, arrival_s, prompt_tokens, output_tokens, max_new_tokens, *,
                 parent=None, delay_s=None, hashed_tokens=None, hash_offsets=None, hash_ids=None,
                 **record_columns):
        cdef Py_ssize_t n = len(arrival_s), i
        for name in record_columns:
            if name not in COLUMNS or name in ("prompt_tokens", "max_new_tokens"):
                raise TypeError(f"Requests: no column {name!r} (the arrival record's: "
                                f"{', '.join(COLUMNS)})")
        # the record columns given (None: the default for every row)
        cdef list given = [(name, col) for name, col in record_columns.items() if col is not None]
        for name, col in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens),
                          ("max_new_tokens", max_new_tokens), *given, ("parent", parent),
                          ("delay_s", delay_s), ("hashed_tokens", hashed_tokens)):
            _column(name, col, n)
        if (parent is None) != (delay_s is None):
            raise ValueError("parent and delay_s go together")
        if (hash_offsets is None) != (hash_ids is None):
            raise ValueError("hash_offsets and hash_ids go together")
        if hash_offsets is not None and len(hash_offsets) != n + 1:
            raise ValueError(f"hash_offsets: {len(hash_offsets)} entries, expected {n + 1}")
        cdef ArrivalRecord r
        cdef dict values = dict(DEFAULTS)
        cdef double t, last = -1e300, dl
        cdef int64_t par, out, hashed
        self.records.reserve(n)
        for i in range(n):
            values["prompt_tokens"] = prompt_tokens[i]
            values["max_new_tokens"] = max_new_tokens[i]
            for name, col in given:
                values[name] = col[i]
            r = values
            check_record(&r, i)
            if r.max_new_tokens < 1:     # a workload's requests generate (no pooling ones)
                raise ValueError(f"max_new_tokens[{i}]={r.max_new_tokens}: must be >= 1")
            out = output_tokens[i]
            if out < 1 or out > r.max_new_tokens:
                raise ValueError(f"output_tokens[{i}]={out}: must be in [1, "
                                 f"max_new_tokens[{i}]={r.max_new_tokens}]")
            par = parent[i] if parent is not None else -1
            if par < -1:
                raise ValueError(f"parent[{i}]={par}: must be -1 or an earlier request's index")
            dl = delay_s[i] if delay_s is not None else 0.0
            if not (isfinite(dl) and dl >= 0.0):
                raise ValueError(f"delay_s[{i}]={dl}: must be a finite number >= 0")
            t = arrival_s[i]
            if par < 0:
                if not isfinite(t) or t < last:
                    raise ValueError(f"arrival_s[{i}]={t}: arrivals must be finite and not decrease")
                last = t
            hashed = hashed_tokens[i] if hashed_tokens is not None else r.prompt_tokens
            if hashed < 0:
                raise ValueError(f"hashed_tokens[{i}]={hashed}: must be >= 0")
            self.records.push_back(r)
            self.output_tokens.push_back(out)
            self.parent.push_back(par)
            self.delay_s.push_back(dl)
            self.arrival_s.push_back(t if par < 0 else -1.0)
            self.hashed_tokens.push_back(hashed)
        self.has_hash_ids = hash_offsets is not None
        self.hash_offsets.push_back(0)
        if self.has_hash_ids:
            for i in range(n):
                if hash_offsets[i + 1] < hash_offsets[i]:
                    raise ValueError(f"hash_offsets[{i + 1}]={hash_offsets[i + 1]}: must not be "
                                     f"below hash_offsets[{i}]={hash_offsets[i]}")
                self.hash_offsets.push_back(hash_offsets[i + 1] - hash_offsets[0])
            if len(hash_ids) != self.hash_offsets[n]:
                raise ValueError(f"hash_ids: {len(hash_ids)} entries, hash_offsets say "
                                 f"{self.hash_offsets[n]}")
            self.hash_ids.reserve(len(hash_ids))
            for i in range(len(hash_ids)):
                self.hash_ids.push_back(hash_ids[i])
        else:
            for i in range(n):
                self.hash_offsets.push_back(0)

    def check_append(self, Py_ssize_t base, double last_arrival, double horizon, ended):
        """Checks the rows against the engine they are added to (ValueError naming the
        row), what depends on its state: the engine holds `base` requests, a turn's
        parent is an earlier request that has not ended (``ended(i)``: the time
        request i ended, None while it has not; its children were released then),
        and fixed arrivals come neither before `last_arrival` (the engine's last)
        nor before `horizon` (the last advance's until; -inf when not stepped)."""
        cdef Py_ssize_t i
        cdef int64_t par
        cdef double t, last = last_arrival
        for i in range(<Py_ssize_t>self.records.size()):
            par = self.parent[i]
            t = self.arrival_s[i]
            if par >= base + i:
                raise ValueError(f"parent[{i}]={par}: must be -1 or an earlier request's index")
            if 0 <= par < base:
                done = ended(par)
                if done is not None:
                    raise ValueError(f"parent[{i}]={par}: already finished or refused at "
                                     f"{done}; add a turn before its parent ends")
            if par < 0:
                if t < last:
                    raise ValueError(f"arrival_s[{i}]={t}: arrivals must not decrease (the "
                                     f"engine's last is {last})")
                if t < horizon:
                    raise ValueError(f"arrival_s[{i}]={t}: before the engine's horizon "
                                     f"{horizon} (the last advance's until)")
                last = t

    def __len__(self):
        return self.records.size()

    def record(self, Py_ssize_t i) -> dict:
        """Row i's arrival record (as a dict of its fields)."""
        if not 0 <= i < <Py_ssize_t>self.records.size():
            raise IndexError(f"row {i}: out of range [0, {self.records.size()})")
        return self.records[i]

    def row(self, Py_ssize_t i) -> dict:
        """Row i whole: its arrival record's fields and the engine's columns
        (arrival_s, output_tokens, parent, delay_s, hashed_tokens, and hash_ids: its
        prefix-block ids, None without any), for an engine in Python
        (kvadmit.simulate.vllm_engine)."""
        d = self.record(i)
        d.update(arrival_s=self.arrival_s[i], output_tokens=self.output_tokens[i],
                 parent=self.parent[i], delay_s=self.delay_s[i],
                 hashed_tokens=self.hashed_tokens[i],
                 hash_ids=[self.hash_ids[k] for k in range(self.hash_offsets[i],
                                                            self.hash_offsets[i + 1])]
                 if self.has_hash_ids else None)
        return d
