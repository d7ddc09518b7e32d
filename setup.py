"""The one build step pyproject.toml cannot state: dlad's C++ core (``dlad/native/``), the native
data plane that serves every request, with its scheduler.

It is required: a build that fails stops the install with the compiler's error. Release wheels
(``[tool.cibuildwheel]`` in pyproject.toml: manylinux x86_64 and aarch64, the latter for
JetPack's Ubuntu) carry it built, so a Jetson needs no compiler.
"""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "dlad._native",
            sorted(glob("dlad/native/*.cpp")),
            depends=sorted(glob("dlad/native/*.hpp") + glob("clients/dlad_wire/native/*.hpp")),
            # the wire's rules (a name, the pixel formats): dlad-client's headers, shared
            include_dirs=["clients/dlad_wire/native"],
            cxx_std=17,
            # one rounding on every host: no fused multiply-adds (aarch64), so the scheduler's
            # estimates are the same numbers on a Jetson as on x86_64
            extra_compile_args=["-O2", "-ffp-contract=off", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["dl"],  # dlopen: the plane calls the libzmq pyzmq loaded (glibc < 2.34)
        )
    ],
    cmdclass={"build_ext": build_ext},
)
