"""vLLM's own scheduler tests from a release's source distribution on PyPI, run on the
installed vLLM as they are and with kvadmit's pass-through (upstream_passthrough.py).

    python tests/vllm/upstream_release.py fetch 0.34.0 .upstream    # .ci/run does this

`fetch` takes the release's sdist (PyPI's JSON index; the wheel ships no tests) and keeps
its tests/ under DEST/vllm-VERSION/ (git-ignored). `run` runs the FILES there with
pytest in a subprocess and returns each test's outcome. The tests name Hugging Face
models; the two they build schedulers from are given, offline, as kvadmit's tiny model
(nothing runs a model: only each model's config is read).
"""
from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
FILES = ("tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py",
         "tests/v1/core/test_priority_preemption_bug.py",
         "tests/v1/core/test_priority_scheduler_random.py")
KEEP = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/core/",
        "tests/v1/kv_connector/")
MODELS = ("facebook/opt-125m", "facebook/opt-350m")


def fetch(version: str, dest: pathlib.Path) -> pathlib.Path:
    """DEST/vllm-VERSION with the sdist's tests (kept if already there)."""
    root = dest / f"vllm-{version}"
    if (root / FILES[0]).exists():
        return root
    index = urllib.request.Request("https://pypi.org/simple/vllm/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(index, timeout=120))["files"]
    url = next((f["url"] for f in files if f["filename"] == f"vllm-{version}.tar.gz"), None)
    if url is None:
        raise SystemExit(f"PyPI has no source distribution vllm-{version}.tar.gz")
    data = urllib.request.urlopen(url, timeout=600).read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        prefix = f"vllm-{version}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(KEEP)]
        tar.extractall(dest, members=members, filter="data")
    return root


def offline_models(hf_home: pathlib.Path) -> None:
    """MODELS in a Hugging Face cache at HF_HOME, each kvadmit's tiny model."""
    from kvadmit.vllm.tiny_model import build_tiny_llama
    src = pathlib.Path(build_tiny_llama(hf_home / "tiny"))
    commit = "0" * 40
    for repo in MODELS:
        base = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(commit)
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, snap / f.name)


def run(root: pathlib.Path, pass_through: bool) -> dict[str, str]:
    """Each upstream test's outcome ('pass', 'fail', 'skip'), by file::name."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        offline_models(tmp / "hf")
        env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1",
               "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join([str(HERE), str(root)])}
        cmd = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
               "-p", "no:randomly", f"--junitxml={tmp / 'out.xml'}", *FILES]
        if pass_through:
            cmd[4:4] = ["-p", "upstream_passthrough"]
        subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=1800)
        return outcomes(tmp / "out.xml")


def outcomes(junit: pathlib.Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        out[name] = ("fail" if tags & {"failure", "error"} else
                     "skip" if "skipped" in tags else "pass")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "fetch":
        sys.exit("usage: upstream_release.py fetch VERSION DEST")
    print(fetch(sys.argv[2], pathlib.Path(sys.argv[3])))
