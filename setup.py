"""Builds the compiled core, kvadmit._native and the modules it builds on, from the
Cython sources in native/kvadmit/, and lays out the packages; the metadata lives in
pyproject.toml.
"""
import os

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

# The package lives under scheduler/ (src layout); engine patches under patches/
# install as the package kvadmit_patches.
packages = find_packages("scheduler") + ["kvadmit_patches"] + [
    "kvadmit_patches." + p for p in find_packages("patches")]
package_dir = {"": "scheduler", "kvadmit_patches": "patches"}
# The bundled traces (scheduler/kvadmit/data/: gzip-compressed, with their sources and
# licences): the main job and `kvadmit simulate --trace NAME` read them from the
# installed package, so a wheel carries them (tests/test_bundled_traces.py checks one).
package_data = {"kvadmit": ["data/*.gz", "data/README.md"]}

# The compiled core: one extension module per part, each native/kvadmit/<name>.pyx
# with a .pxd declaring the C-level API its users cimport. native/ is on Cython's
# include path, so `from kvadmit._allocator cimport BlockAllocator` finds
# native/kvadmit/_allocator.pxd, and every module compiles under the name Python
# imports it by. Leaves first; kvadmit._native re-exports them all.
NATIVE_MODULES = ["_free_queue", "_allocator", "_curves", "_length_model", "_step_time",
                  "_agent_window", "_session_hold", "_slo_guard", "_arrival", "_arrival_gate",
                  "_ledger", "_flows", "_waiting_queue", "_shortfall", "_policies", "_victims",
                  "_decision", "_core_view", "_core", "_step_plan", "_requests", "_engine_state",
                  "_native_engine", "_native"]

extensions = [
    Extension(
        f"kvadmit.{name}",
        sources=[f"native/kvadmit/{name}.pyx"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17"],
    )
    for name in NATIVE_MODULES
]

# Every core compiles the extension modules (they are independent once cythonized):
# the build, the wheel of a fresh clone in the tests and CI's install take half the time
# on two cores.
JOBS = os.cpu_count() or 1

setup(
    packages=packages,
    package_dir=package_dir,
    package_data=package_data,
    options={"build_ext": {"parallel": JOBS}},
    ext_modules=cythonize(
        extensions,
        nthreads=JOBS,
        include_path=["native"],
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "embedsignature": True,
        },
    )
)
