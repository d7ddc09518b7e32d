"""The one build step pyproject.toml cannot state: the wire's rules (``dlad_wire/native/``),
C++ headers the daemon compiles into its decoder too, bound for the SDK as ``dlad_wire._rules``.
Release wheels (``[tool.cibuildwheel]``) carry it built."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "dlad_wire._rules",
            ["dlad_wire/native/rules.cpp"],
            depends=["dlad_wire/native/names.hpp", "dlad_wire/native/frames.hpp"],
            include_dirs=["dlad_wire/native"],
            cxx_std=17,
            extra_compile_args=["-O2"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
