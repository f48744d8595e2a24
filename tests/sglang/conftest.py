"""Test set-up for the SGLang plug-in tests (CPU).

TEST-ONLY IMPORT SHIM FOR TORCHVISION. SGLang 0.5.23's scheduler import chain
reaches ``torchvision`` at import time (``sglang/srt/configs/__init__.py`` ->
multimodal helpers), although nothing these tests run uses it. The only
torchvision wheels on PyPI for this environment pull in CUDA torch, so the
tests do not install it. Instead, while (and only while) SGLang's scheduling
modules are first imported, a stub ``torchvision`` package is placed in
``sys.modules``; any use of it raises. The stub is removed right after the
import, and transformers' "is torchvision available" answer is computed
(False) before the stub exists, so nothing else sees it. This shim is never
used outside the tests: a real SGLang server has a real torchvision.

When SGLang is not installed, this file does nothing and the test modules in
this folder are not collected (each also has ``pytest.importorskip("sglang.srt")``).
"""
from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings

import pytest



def _have_sglang() -> bool:
    # Not find_spec("sglang"): pytest puts tests/ on sys.path, where this folder
    # (tests/sglang, no __init__.py) is a namespace package named "sglang" when
    # the real SGLang is absent. The real one is found through sglang.srt.
    try:
        return importlib.util.find_spec("sglang.srt") is not None
    except ImportError:
        return False


HAVE_SGLANG = _have_sglang()
if not HAVE_SGLANG:
    # Do not even import the modules: each would pull this folder in as a fake
    # "sglang" namespace package before its importorskip fires.
    collect_ignore_glob = ["test_sglang_*.py", "sglang_harness.py"]
_STUB_NAMES = (
    "torchvision", "torchvision.transforms", "torchvision.transforms.functional",
    "torchvision.transforms.v2", "torchvision.transforms.v2.functional",
    "torchvision.io", "torchvision.ops",
)


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _stub_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []
    mod.__version__ = "0.0.0+kvadmit-test-stub"

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        class _Unavailable:
            def __init__(self, *args, **kwargs):
                raise RuntimeError(f"torchvision test stub: {name}.{attr} is not available")

        _Unavailable.__name__ = attr
        return _Unavailable

    mod.__getattr__ = __getattr__
    return mod


def _import_sglang_with_torchvision_stub() -> None:
    if importlib.util.find_spec("torchvision") is not None:  # a real one: no shim
        _import_sglang()
        return
    try:  # answer transformers' availability checks truthfully before the stub exists
        from transformers.utils import import_utils
        import_utils.is_torchvision_available()
        import_utils.is_torchvision_v2_available()
    except Exception:
        pass
    stubs = {name: _stub_module(name) for name in _STUB_NAMES}
    stubs["torchvision.transforms"].InterpolationMode = _InterpolationMode
    stubs["torchvision.transforms.functional"].InterpolationMode = _InterpolationMode
    stubs["torchvision"].transforms = stubs["torchvision.transforms"]
    stubs["torchvision.transforms"].functional = stubs["torchvision.transforms.functional"]
    stubs["torchvision.transforms"].v2 = stubs["torchvision.transforms.v2"]
    stubs["torchvision.transforms.v2"].functional = stubs["torchvision.transforms.v2.functional"]
    sys.modules.update(stubs)
    try:
        _import_sglang()
    finally:
        for name in _STUB_NAMES:
            if sys.modules.get(name) is stubs[name]:
                del sys.modules[name]


def _import_sglang() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.managers.scheduler  # noqa: F401  (~6 s)
        import sglang.srt.managers.schedule_batch  # noqa: F401
        import sglang.srt.managers.schedule_policy  # noqa: F401
        import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
        import sglang.srt.plugins  # noqa: F401


if HAVE_SGLANG:
    os.environ.pop("KVADMIT_CONFIG", None)
    os.environ.pop("SGLANG_PLUGINS", None)
    _import_sglang_with_torchvision_stub()
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu"))


@pytest.fixture
def clean_plugins(monkeypatch):
    """A process state as if SGLang had just started: no plug-in loaded, no
    hooks registered; everything kvadmit's hooks patched is put back after."""
    import sglang.srt.plugins as plugins
    from kvadmit.sglang import plugin
    from sglang.srt.plugins.hook_registry import HookRegistry

    import pkgutil

    hooks_by_target = {**plugin.cli_hooks(), **plugin.engine_hooks()}
    ours = {hook for hook, _ in hooks_by_target.values()}
    saved = []
    for target in hooks_by_target:
        obj_path, _, attr = target.rpartition(".")
        obj = pkgutil.resolve_name(obj_path)
        raw = obj.__dict__.get(attr, _MISSING)
        saved.append((obj, attr, raw))
        if raw is not _MISSING:  # run the test on SGLang's own function
            setattr(obj, attr, _strip_kvadmit(raw, ours))
    hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    patched = set(HookRegistry._patched)
    HookRegistry.reset()
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv("KVADMIT_CONFIG", raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    yield HookRegistry
    for obj, attr, raw in saved:
        if raw is _MISSING:
            if attr in obj.__dict__:
                delattr(obj, attr)
        else:
            setattr(obj, attr, raw)
    HookRegistry.reset()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched.update(patched)


_MISSING = object()


def _strip_kvadmit(raw, ours):
    """``raw`` without the HookRegistry wrappers around kvadmit's hooks."""
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    fn = raw.__func__ if kind else raw
    while any(_cell(c) in ours for c in (getattr(fn, "__closure__", None) or ())):
        fn = fn.__wrapped__
    return kind(fn) if kind else fn


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return None


def install_kvadmit_hooks() -> None:
    """kvadmit's hooks installed the way SGLang does it in a scheduler process:
    KVADMIT_CONFIG set, then SGLang's own load_plugins() (also bench/noisy_neighbour_sglang.py)."""
    import sglang.srt.plugins as plugins

    os.environ["KVADMIT_CONFIG"] = '{"policy": "peak"}'
    try:
        plugins._plugins_loaded = False
        plugins.load_plugins()
    finally:
        os.environ.pop("KVADMIT_CONFIG", None)


@pytest.fixture(scope="session")
def kvadmit_hooks():
    """kvadmit's hooks installed once for the session (install_kvadmit_hooks).
    Hooks are pass-through for a scheduler without a kvadmit adapter, so the
    baseline (SGLang's default) runs through the same patched methods."""
    install_kvadmit_hooks()
    from kvadmit.sglang import plugin

    plugin.verify(plugin.engine_hooks())
    return plugin
