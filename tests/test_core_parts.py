"""The compiled core's parts (native/kvadmit/): each is its own module behind a
C-level API, and the core reaches them through it."""
import pathlib
import re

import pytest

import kvadmit
from kvadmit import AdmissionConfig, AdmissionCore
from kvadmit.arrival import ArrivalRecord

NATIVE = pathlib.Path(__file__).resolve().parents[1] / "native" / "kvadmit"


def test_no_part_reads_another_parts_private_fields():
    # `x._name` where x is anything but `self` (or a module path) reaches into
    # another object's private state: the parts talk through their .pxd APIs.
    found = []
    for path in sorted(NATIVE.glob("*.p[xy][dx]")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in re.finditer(r"([A-Za-z_][\w.]*)\.(_[a-z]\w*)", code):
                owner = m.group(1)
                if owner != "self" and not owner.startswith("kvadmit"):
                    found.append(f"{path.name}:{n}: {m.group(0)}")
    assert found == []
    assert len(list(NATIVE.glob("*.pxd"))) >= 10   # the scan saw the sources


def test_every_noexcept_function_is_nogil():
    # A noexcept cdef function cannot pass an exception to its caller (Cython prints
    # it and goes on); nogil makes the compiler refuse any Python object in it, so
    # none can be raised there in the first place.
    found = []
    for path in sorted(NATIVE.glob("*.p[xy][dx]")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bnoexcept\b", code) and not re.search(r"\bnoexcept\s+nogil\b", code):
                found.append(f"{path.name}:{n}: {code.strip()}")
    assert found == []


@pytest.mark.parametrize("policy", kvadmit.POLICIES)
def test_each_policy_is_its_own_class(policy):
    core = AdmissionCore(AdmissionConfig(policy=policy), 64, 16, 0)
    assert kvadmit.POLICIES[core.policy.kind] == policy
    assert type(core.policy).__name__.lower() == policy + "policy"


def test_the_parts_report_what_stats_report():
    core = AdmissionCore(AdmissionConfig(max_queued_requests=1, agent_window=True), 64, 16, 100)
    assert core.arrive(ArrivalRecord(10, 10), now=0.0).accepted
    assert not core.arrive(ArrivalRecord(10, 10), now=0.1).accepted          # queue full
    assert not core.arrive(ArrivalRecord(90, 20), now=0.2).accepted          # context
    core.refuse_invalid("bad field", "prompt")
    stats = core.stats()
    assert core.gate.rejected() == stats["rejected"]
    assert stats["rejected"]["queue_full"] == 1
    assert stats["rejected"]["context_length"] == 1
    assert stats["rejected"]["invalid"] == 1
    assert core.agent_window.stats() == stats["agent_window"]
    assert core.step_time is core.slo_guard.step_time
    assert core.length_model is core.policy.lengths


def test_the_ledgers_fields_change_only_through_its_transitions():
    # Its per-slot arrays and sums are private (`_name`), so the test above keeps every
    # other module off them: they read a field through the ledger's inline getters and
    # change it through one of its transitions (add, enqueue, start, preempt, ...).
    pxd = (NATIVE / "_ledger.pxd").read_text()
    code = "\n".join(line.split("#", 1)[0].rstrip() for line in pxd.splitlines())
    fields = re.findall(r"^\s+cdef (?:vector\[\w+\]|int64_t|double) ([\w, ]+)$", code, re.M)
    names = [n.strip() for f in fields for n in f.split(",")]
    assert len(names) >= 30, names          # the scan saw the arrays
    assert [n for n in names if not n.startswith("_")] == []
    for name in ("enqueue", "dequeue", "start", "preempt", "cancel_start", "finish", "release"):
        assert re.search(rf"cdef \w+ {name}\(self, int32_t s", pxd), name


def test_setup_builds_every_part_after_the_parts_it_cimports():
    # The cimport graph of native/kvadmit/ has no cycle, and setup.py lists the
    # modules leaves first: each after every module its .pyx or .pxd cimports.
    setup = (NATIVE.parents[1] / "setup.py").read_text()
    listed = re.findall(r'"(_\w+)"', re.search(r"NATIVE_MODULES = \[(.*?)\]", setup, re.S).group(1))
    assert sorted(listed) == sorted(p.stem for p in NATIVE.glob("*.pyx"))
    assert {"_ledger", "_waiting_queue", "_shortfall", "_decision", "_core_view", "_core"} <= set(listed)
    for name in listed:
        uses = set()
        for path in NATIVE.glob(f"{name}.p[xy][dx]"):
            uses |= set(re.findall(r"^from kvadmit\.(_\w+) cimport", path.read_text(), re.M))
        uses.discard(name)
        later = [u for u in uses if listed.index(u) > listed.index(name)]
        assert later == [], f"{name} cimports {later}, listed after it"
