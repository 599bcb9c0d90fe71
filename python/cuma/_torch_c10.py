# SPDX-License-Identifier: Apache-2.0
"""libcuma_torch_c10 built at run time, for a PyTorch that libcuma was not built against.

libcuma_torch_c10 (src/shim/torch/raise_c10.cpp) raises PyTorch's own OutOfMemoryError, but it
is compiled against one PyTorch's headers and ABI. A pip user's PyTorch is usually not the one
(if any) that CMake saw, so cuma.torch.enable() asks library() for one built here: the first
time for a given PyTorch, libcuma and source, the system C++ compiler builds it (about a
second) into a per-user cache; later processes find it there. Without a compiler, PyTorch's C++
headers, the sources or a writable cache, library() returns None and enable() uses
libcuma_torch.so, whose RuntimeError carries the same text.

Environment: CUMA_TORCH_C10_BUILD=0 turns the build off; CUMA_CACHE_DIR chooses the cache
(default $XDG_CACHE_HOME/cuma, else ~/.cache/cuma); CXX chooses the compiler (default c++).
A build that failed leaves its compiler output beside where the library would be
(``*.failed``), and is not tried again for that key.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile

_SOURCES = ("raise_c10.cpp", "failure_text.h")
_HEADERS = ("cuma.h", "torch.h")


def _source_dirs():
    """(directory of raise_c10.cpp, include directory holding cuma/torch.h), or None: the copy
    an installed package carries (_c10src), else the source tree this package sits in."""
    here = os.path.dirname(os.path.abspath(__file__))
    shipped = os.path.join(here, "_c10src")
    tree = os.path.normpath(os.path.join(here, "..", ".."))
    for src, inc in ((shipped, shipped), (os.path.join(tree, "src", "shim", "torch"), os.path.join(tree, "include"))):
        if all(os.path.isfile(os.path.join(src, n)) for n in _SOURCES) and all(
            os.path.isfile(os.path.join(inc, "cuma", n)) for n in _HEADERS
        ):
            return src, inc
    return None


def cache_dir():
    """Where built libraries are kept for this user."""
    d = os.environ.get("CUMA_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "cuma")
    return d


def _key(parts, files):
    h = hashlib.sha256()
    for p in parts:
        h.update(str(p).encode() + b"\0")
    for f in files:
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def library(torch, libcuma_path):
    """Path of a libcuma_torch_c10 for this `torch` module linked to `libcuma_path` (the
    libcuma this process uses, so that both share the default heaps), built now if the cache
    has none; None when it cannot be had (the reason, for a failed build, is in the cache)."""
    if os.environ.get("CUMA_TORCH_C10_BUILD", "1") == "0":
        return None
    version = getattr(torch, "__version__", None)
    torch_file = getattr(torch, "__file__", None)
    dirs = _source_dirs()
    if not version or not torch_file or dirs is None:
        return None
    root = os.path.dirname(torch_file)
    include, libdir = os.path.join(root, "include"), os.path.join(root, "lib")
    c10 = os.path.join(libdir, "libc10.so")
    if not os.path.isfile(os.path.join(include, "c10", "util", "Exception.h")) or not os.path.isfile(c10):
        return None
    cxx = shutil.which(os.environ.get("CXX") or "c++")
    if cxx is None:
        return None
    libcuma = os.path.realpath(libcuma_path)
    try:
        st = os.stat(libcuma)
        abi = 1 if getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True) else 0
        src, inc = dirs
        files = [os.path.join(src, n) for n in _SOURCES] + [os.path.join(inc, "cuma", n) for n in _HEADERS]
        key = _key((version, root, libcuma, st.st_size, st.st_mtime_ns, cxx, abi), files)
    except (OSError, AttributeError):
        return None
    out_dir = cache_dir()
    out = os.path.join(out_dir, "libcuma_torch_c10-%s-%s.so" % (version, key))
    if os.path.isfile(out):
        return out
    if os.path.exists(out + ".failed"):
        return None
    try:
        os.makedirs(out_dir, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError:
        return None
    cmd = [
        cxx, "-shared", "-fPIC", "-O2", "-std=c++17", "-fvisibility=hidden",
        "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi, '-DCUMA_TORCH_VERSION="%s"' % version,
        "-I", inc, "-isystem", include, os.path.join(src, "raise_c10.cpp"), "-o", tmp,
        libcuma, c10, "-Wl,--no-undefined",
        "-Wl,-rpath," + os.path.dirname(libcuma), "-Wl,-rpath," + libdir,
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        ok, log = r.returncode == 0, r.stdout
    except (OSError, subprocess.SubprocessError) as e:
        ok, log = False, str(e).encode()
    try:
        if ok:
            os.replace(tmp, out)  # atomic: processes building at once each leave a whole file
            return out
        os.unlink(tmp)
        with open(out + ".failed", "wb") as f:
            f.write(b" ".join(c.encode() for c in cmd) + b"\n" + log)
    except OSError:
        pass
    return None
