"""The one build step pyproject.toml cannot state: dlad's scheduler core in C++ (``dlad/native/``).

It is optional: where no C++ compiler is found, pip installs dlad without it and the daemon runs
the Python scheduler (``dlad/scheduler.py``), which is also the reference the core is tested
against (``tests/dlad/test_native_scheduler.py``).
"""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "dlad._native",
            sorted(glob("dlad/native/*.cpp")),
            depends=sorted(glob("dlad/native/*.hpp")),
            cxx_std=17,
            # the Python scheduler's rounding on every host: no fused multiply-adds (aarch64)
            extra_compile_args=["-O2", "-ffp-contract=off", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["dl"],  # dlopen: the plane calls the libzmq pyzmq loaded (glibc < 2.34)
            optional=True,
        )
    ],
    cmdclass={"build_ext": build_ext},
)
