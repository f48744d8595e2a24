"""The core must be a real compiled extension, not Python pretending to be one."""
import importlib.machinery
import inspect
import pathlib

import kvadmit
from kvadmit import _native

# The compiled modules setup.py builds (native/kvadmit/*.pyx).
NATIVE_MODULES = sorted(p.stem for p in (pathlib.Path(__file__).resolve().parents[1]
                                         / "native" / "kvadmit").glob("*.pyx"))


def test_native_module_is_an_extension_module():
    path = pathlib.Path(_native.__file__)
    assert path.suffix in importlib.machinery.EXTENSION_SUFFIXES or any(
        path.name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES), path
    assert isinstance(_native.__loader__, importlib.machinery.ExtensionFileLoader)
    assert _native.COMPILED is True


def test_core_classes_are_extension_types():
    for cls in (kvadmit.AdmissionCore, kvadmit.BlockAllocator, kvadmit.FreeBlockQueue,
                kvadmit.BlockObjectQueue, kvadmit.OutputLengthModel):
        # Each lives in one of the core's compiled modules (kvadmit._native re-exports them).
        assert getattr(_native, cls.__name__) is cls
        module = importlib.import_module(cls.__module__)
        assert cls.__module__.startswith("kvadmit._"), cls.__module__
        assert isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader), cls.__module__
        # Extension types have no Python source and no instance __dict__.
        assert not hasattr(cls, "__dict__") or "__dict__" not in cls.__dict__
        try:
            inspect.getsource(cls)
            raise AssertionError(f"{cls.__name__} has Python source")
        except (TypeError, OSError):
            pass


def test_no_python_fallback_module_next_to_the_extension():
    pkg = pathlib.Path(kvadmit.__file__).parent
    for name in NATIVE_MODULES:
        assert not (pkg / f"{name}.py").exists(), name


def test_every_native_module_is_an_extension_module():
    assert {"_native", "_allocator", "_curves"} <= set(NATIVE_MODULES), NATIVE_MODULES
    for name in NATIVE_MODULES:
        module = importlib.import_module(f"kvadmit.{name}")
        assert isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader), name


def test_the_sdist_ships_the_cython_sources(tmp_path):
    """setup.py cythonizes native/kvadmit/*.pyx (cimporting their .pxd): an sdist with
    only the generated .cpp could not be built (pip wheel of it failed with
    "'native/kvadmit/_free_queue.pyx' doesn't match any files")."""
    import subprocess
    import sys
    import tarfile
    root = pathlib.Path(__file__).resolve().parents[1]
    # a fresh egg-info: a stale one's SOURCES.txt would list the files by itself
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "-e", str(tmp_path), "sdist",
                    "-d", str(tmp_path)], cwd=root, check=True, capture_output=True, timeout=300)
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        shipped = {pathlib.PurePosixPath(*pathlib.PurePosixPath(n).parts[1:]).as_posix()
                   for n in tar.getnames()}
    sources = {p.relative_to(root).as_posix()
               for p in (root / "native" / "kvadmit").glob("*.p[xy][dx]")}
    assert len(sources) >= 27 and sources <= shipped, sorted(sources - shipped)
