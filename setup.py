"""Builds the compiled core, kvadmit._native, from the Cython sources in native/.

Everything else (metadata, package layout) lives in pyproject.toml.
"""
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "kvadmit._native",
        sources=["native/_native.pyx"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17"],
    )
]

setup(
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
