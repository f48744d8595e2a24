# cython: language_level=3
"""kvadmit's compiled core: KV block allocator, request ledger, admission
policies, caps and victim selection. Engine adapters, the simulator and the
benchmarks all drive this one module."""

from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact
from cpython.object cimport PyObject, Py_TYPE
from cython.operator cimport dereference as deref, preincrement as inc
from libc.math cimport ceil, isfinite, sqrt, INFINITY
from libc.stdlib cimport llabs
from libc.stdint cimport int32_t, int64_t, uint64_t, INT64_MAX
from libcpp.algorithm cimport sort
from libcpp.deque cimport deque
from libcpp.map cimport map as cmap
from libcpp.pair cimport pair
from libcpp.queue cimport priority_queue
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

include "free_queue.pxi"
include "allocator.pxi"
include "curves.pxi"
include "length_model.pxi"
include "slo.pxi"
include "core.pxi"
include "sim.pxi"

COMPILED = True
"""Set only by the compiled module (tests check it is a real extension)."""
