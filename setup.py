"""Builds the compiled core, kvadmit._native, from the Cython sources in native/.

and lays out the packages; the metadata lives in pyproject.toml.
"""
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

# The package lives under scheduler/ (src layout); engine patches under patches/
# install as the package kvadmit_patches.
packages = find_packages("scheduler") + ["kvadmit_patches"] + [
    "kvadmit_patches." + p for p in find_packages("patches")]
package_dir = {"": "scheduler", "kvadmit_patches": "patches"}

extensions = [
    Extension(
        "kvadmit._native",
        sources=["native/_native.pyx"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17"],
    )
]

setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=cythonize(
        extensions,
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
