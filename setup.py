# SPDX-License-Identifier: Apache-2.0
"""Builds the native parts of the cuma package with the project's CMake.

`pip install .` runs this through setuptools' PEP 517 backend (pyproject.toml). Before the
Python files are copied, CMake configures and builds libcuma, libcuma_preload.so,
libcuma_torch.so (where a C++ compiler exists), libcuma_torch_c10-<torch version>.so (where
this interpreter's PyTorch has its C++ headers; its sources go along as cuma/_c10src, for a
build at run time against another PyTorch) and the `cuma` command in a build directory of
setuptools' own, and they are copied into the package: the library under its soname,
cuma/libcuma.so.0 (the name libcuma_torch.so asks for through $ORIGIN, and one the package's
library search tries next to itself, so the process maps one copy), the command as
cuma/bin/cuma, which the `cuma` console entry point (cuma/_cli.py) runs.

Environment: CUMA_CMAKE_ARGS (extra cmake arguments, split on spaces), CUMA_BUILD_JOBS.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(cuma\s+VERSION\s+([0-9.]+)", f.read())
    if not m:
        raise RuntimeError("CMakeLists.txt: no project(cuma VERSION x.y.z) to take the version from")
    return m.group(1)


class BinaryDistribution(Distribution):
    """The wheel holds native code: tagged for this platform and Python, not py3-none-any."""

    def has_ext_modules(self):
        return True


class build_native(build_py):
    """build_py that first builds the C libraries and the command with CMake."""

    def run(self):
        super().run()
        build_temp = os.path.abspath(self.get_finalized_command("build").build_temp)
        cmake_dir = os.path.join(build_temp, "cmake")
        args = [
            "cmake", "-S", ROOT, "-B", cmake_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DCUMA_BUILD_TESTS=OFF",
            "-DCUMA_PYTHON_DIR=",  # the package is installed by pip, not by CMake
            # libcuma_torch_c10 is built against the PyTorch of the interpreter installing
            # the package (under build isolation that one usually has none: it is skipped).
            "-DCUMA_PYTHON=" + sys.executable,
        ] + os.environ.get("CUMA_CMAKE_ARGS", "").split()
        self._run(args)
        targets = ["cuma_shared", "cuma_cli"]
        # Built where CUDA headers / C++ / PyTorch's C++ headers exist.
        for opt in ("cuma_preload", "cuma_torch", "cuma_torch_c10"):
            if self._has_target(cmake_dir, opt):
                targets.append(opt)
        jobs = os.environ.get("CUMA_BUILD_JOBS") or str(os.cpu_count() or 1)
        self._run(["cmake", "--build", cmake_dir, "-j", jobs, "--target"] + targets)
        pkg = os.path.join(os.path.abspath(self.build_lib), "cuma")
        os.makedirs(os.path.join(pkg, "bin"), exist_ok=True)
        lib = os.path.join(cmake_dir, "lib")
        # Real files only: a wheel cannot hold symbolic links.
        self._copy(os.path.join(lib, "libcuma.so.0"), os.path.join(pkg, "libcuma.so.0"))
        c10 = [n for n in os.listdir(lib) if n.startswith("libcuma_torch_c10-") and n.endswith(".so")]
        for name in ["libcuma_preload.so", "libcuma_torch.so"] + c10:
            if os.path.exists(os.path.join(lib, name)):
                self._copy(os.path.join(lib, name), os.path.join(pkg, name))
        self._copy(os.path.join(cmake_dir, "bin", "cuma"), os.path.join(pkg, "bin", "cuma"))
        # The sources cuma/_torch_c10.py builds libcuma_torch_c10 from at run time, for a
        # PyTorch other than the one (if any) found here.
        src = os.path.join(pkg, "_c10src")
        os.makedirs(os.path.join(src, "cuma"), exist_ok=True)
        for name in ("raise_c10.cpp", "failure_text.h"):
            self._copy(os.path.join(ROOT, "src", "shim", "torch", name), os.path.join(src, name))
        for name in ("cuma.h", "torch.h"):
            self._copy(os.path.join(ROOT, "include", "cuma", name), os.path.join(src, "cuma", name))

    @staticmethod
    def _has_target(cmake_dir, target):
        # The generated build system lists every target it knows.
        out = subprocess.run(["cmake", "--build", cmake_dir, "--target", "help"],
                             stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
        return re.search(r"\b%s\b" % re.escape(target), out) is not None

    @staticmethod
    def _copy(src, dst):
        shutil.copyfile(os.path.realpath(src), dst)
        shutil.copymode(os.path.realpath(src), dst)

    @staticmethod
    def _run(args):
        print(" ".join(args), flush=True)
        subprocess.check_call(args, stdout=sys.stderr)


setup(
    version=_version(),
    package_dir={"": "python"},
    packages=["cuma"],
    distclass=BinaryDistribution,
    cmdclass={"build_py": build_native},
    # setuptools' default build folder is build/, which is the project's CMake build folder.
    options={"build": {"build_base": "build-py"}, "egg_info": {"egg_base": "build-py"}},
    zip_safe=False,
)
