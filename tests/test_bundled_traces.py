"""The traces bundled in the package (scheduler/kvadmit/data/): they hold the same
requests as the originals in ../shared/traces/, load by name, ship in the wheel, and
a fresh `git clone` with no ../shared beside it runs the commands that read them."""
import gzip
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from kvadmit.traces import BUNDLED, DATA_DIR, TraceError, load_trace, trace_name, trace_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
ORIGINALS = {"azure2023_conv": "azure2023_conv.csv",
             "mooncake_conversation": "mooncake_conversation_trace.jsonl"}
COUNTS = {"azure2023_conv": 19366, "mooncake_conversation": 12031}   # ../shared/traces/README.md
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/traces")


def digest(requests) -> str:
    """A fingerprint of every request's fields, to compare two loads across processes."""
    h = hashlib.sha256()
    for r in requests:
        h.update(repr((round(r.arrival_s, 6), r.prompt_tokens, r.output_tokens, r.hash_ids)).encode())
    return h.hexdigest()


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_every_bundled_trace_loads_whole(name):
    reqs = load_trace(name)
    assert len(reqs) == COUNTS[name]
    assert reqs[0].arrival_s == 0.0 and all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert (DATA_DIR / "README.md").read_text().count(name) >= 1


@needs_shared
@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_copy_is_the_original(name):
    original = SHARED / ORIGINALS[name]
    with gzip.open(trace_path(name), "rb") as f:
        assert f.read() == original.read_bytes()
    assert load_trace(name) == load_trace(original)


def test_names_paths_and_errors(tmp_path):
    assert trace_path("azure2023_conv") == DATA_DIR / "azure2023_conv.csv.gz"
    assert trace_path("x/azure2023_conv") == pathlib.Path("x/azure2023_conv")   # a path, not a name
    assert [trace_name(t) for t in ("azure2023_conv", "a/b/azure2023_conv.csv",
                                    "c.jsonl.gz", DATA_DIR / "mooncake_conversation_trace.jsonl.gz")] == \
        ["azure2023_conv", "azure2023_conv", "c", "mooncake_conversation_trace"]
    # an explicit path still works, plain or gzip-compressed
    head = ROOT / "tests" / "data" / "azure2023_conv_head200.csv"
    gz = tmp_path / "head.csv.gz"
    gz.write_bytes(gzip.compress(head.read_bytes()))
    assert load_trace(gz) == load_trace(head) == load_trace("azure2023_conv", limit=200)
    with pytest.raises(FileNotFoundError, match="trace not found: nope.csv .*azure2023_conv, "
                                                "mooncake_conversation"):
        load_trace("nope.csv")
    bad = tmp_path / "t.txt.gz"
    bad.write_bytes(gzip.compress(b"x"))
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(bad)


def test_the_commands_default_to_the_bundled_traces():
    """No default names ../shared: the main job, the simulator's docs, the scorecard and
    the bench scripts all read the bundled copies unless told otherwise."""
    from kvadmit.simulate import scorecard
    from kvadmit.simulate.workload import from_trace
    files = [*(ROOT / "scheduler" / "kvadmit").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
             *(ROOT / "bench").glob("*.sh"), ROOT / "README.md"]
    assert not [str(f.relative_to(ROOT)) for f in files if "shared/traces" in f.read_text()]
    cases = {c.name: c for c in scorecard.suite(quick=True)}
    assert len(cases["azure-context"].workload) == 64
    w = from_trace("mooncake_conversation", limit=10)
    assert w.name == "mooncake_conversation" and w.hash_ids is not None


# ---------------------------------------------------------------------------
# A fresh clone, with no ../shared beside it

@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """`git clone` of this repository's committed HEAD into an empty folder."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    top = tmp_path_factory.mktemp("fresh")
    dest = top / "kvadmit"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True, timeout=120,
                   capture_output=True)
    assert not (top / "shared").exists() and not (dest.parent / "shared").exists()
    return dest


@pytest.fixture(scope="module")
def wheel(clone, tmp_path_factory):
    """The wheel a non-editable `pip install` of the clone would install (built from the
    clone's tree, nothing installed), unpacked: a site folder with the compiled core."""
    dist = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(dist), str(clone)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (whl,) = dist.glob("kvadmit-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        z.extractall(site)
    return whl, names, site


def test_a_fresh_clone_carries_the_traces(clone):
    for name, file in BUNDLED.items():
        copy = clone / "scheduler" / "kvadmit" / "data" / file
        assert copy.read_bytes() == trace_path(name).read_bytes(), file
    assert "CC BY 4.0" in (clone / "scheduler" / "kvadmit" / "data" / "README.md").read_text()


def test_the_wheel_contains_the_traces(wheel):
    _, names, _ = wheel
    for file in [*BUNDLED.values(), "README.md"]:
        assert f"kvadmit/data/{file}" in names, sorted(n for n in names if "data" in n)


def run_from_clone(site, clone, *args, timeout=600):
    """A command run in the clone's folder on the wheel's kvadmit (not this checkout's)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_installed_package_reads_its_own_traces(wheel, clone):
    """The same requests as ../shared's files (or as this checkout's bundled copies when
    ../shared is absent), loaded by the wheel's kvadmit from inside the clone."""
    _, _, site = wheel
    want = {name: digest(load_trace(SHARED / ORIGINALS[name] if SHARED.is_dir() else name))
            for name in BUNDLED}
    script = ("import json, kvadmit, kvadmit.traces as t, sys; sys.path.insert(0, 'tests'); "
              "from test_bundled_traces import digest; "
              "print(json.dumps({'file': kvadmit.__file__, 'data': str(t.DATA_DIR), "
              "**{n: digest(t.load_trace(n)) for n in t.BUNDLED}}))")
    p = run_from_clone(site, clone, "-c", script)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert got.pop("file").startswith(str(site)) and got.pop("data").startswith(str(site))
    assert got == want


def test_the_commands_run_from_a_fresh_clone(wheel, clone):
    """The simulator and the scorecard on their default (bundled) traces, and the main
    job's workload (`kvadmit bench vllm`'s default: the first 256 Azure requests)."""
    _, _, site = wheel
    p = run_from_clone(site, clone, "-m", "kvadmit.cli", "simulate", "--trace", "azure2023_conv",
                       "--requests", "300", "--preset", "h100-8b", "--load", "1.0",
                       "--policies", "vllm-default", "auto", "--quiet")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "auto" in p.stdout and "vllm-default" in p.stdout
    p = run_from_clone(site, clone, "-m", "kvadmit.cli", "bench", "scorecard", "--quick", "--only",
                       "azure-context", "mooncake-prefix", "--json", "", "--plot", "")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "azure-context" in p.stdout and "mooncake-prefix" in p.stdout
    pytest.importorskip("vllm")
    from kvadmit.bench.vllm import build_workload
    reference = SHARED / ORIGINALS["azure2023_conv"] if SHARED.is_dir() else "azure2023_conv"
    want, _ = build_workload("azure", 256, 1024, 2048, "cap", True, str(reference))
    script = ("import hashlib; from kvadmit.bench.vllm import build_workload; "
              "w, s = build_workload('azure', 256, 1024, 2048, 'cap', True); "
              "print(s); print(hashlib.sha256(repr(w).encode()).hexdigest())")
    p = run_from_clone(site, clone, "-c", script)
    assert p.returncode == 0, p.stderr[-3000:]
    source, got = p.stdout.splitlines()[-2:]
    assert source.startswith("first 256 requests of azure2023_conv")
    assert got == hashlib.sha256(repr(want).encode()).hexdigest()
