# SPDX-License-Identifier: Apache-2.0
"""cuma.torch.enable() as far as it can go without a GPU: a stand-in for a CUDA build of
PyTorch 2.x records what enable() hands to CUDAPluggableAllocator, and the default heap is on
the fake CUDA driver (tests/fakecuda), so the path that refuses the simulated device is passed.
What PyTorch would load is then loaded and called the way PyTorch calls it (ctypes here: a
successful allocation and its free; test_torch_raise and test_torch_c10 cover the exceptions
in C++). Which library enable() picks (libcuma_torch_c10 for the PyTorch it was built for,
else libcuma_torch.so) is checked here too."""

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import cuma
from cuma import _lib

_CHILD = textwrap.dedent(
    r"""
    import ctypes, json, os, sys, types

    class Cpp:
        def __init__(self):
            self.hooks = {}
        def __getattr__(self, name):
            if name.startswith("set_"):
                return lambda fn: self.hooks.__setitem__(name[4:], fn)
            raise AttributeError(name)

    class Pluggable:
        def __init__(self, path, malloc_name, free_name):
            self.args = (path, malloc_name, free_name)
            self.cpp = Cpp()
        def allocator(self):
            return self.cpp

    swapped = []
    memory = types.SimpleNamespace(CUDAPluggableAllocator=Pluggable,
                                   change_current_allocator=swapped.append)
    torch = types.ModuleType("torch")
    torch.__version__ = os.environ.get("STANDIN_TORCH_VERSION", "2.11.0+stand-in")
    torch.version = types.SimpleNamespace(cuda="13.0", hip=None)
    torch.cuda = types.SimpleNamespace(memory=memory, is_initialized=lambda: False)
    sys.modules["torch"] = torch

    import cuma
    alloc = cuma.torch.enable("limit:256M")
    # Nothing of the driver yet: no heap, no context on device 0 (each rank of a job on many
    # GPUs calls enable(), and a parent may fork after it).
    fake = ctypes.CDLL(os.environ["CUMA_CUDA_LIBRARY"])
    fake.fakecuda_calls.restype = ctypes.c_ulong
    fake.fakecuda_calls.argtypes = [ctypes.c_char_p]
    at_enable = {"heaps": sorted(cuma.heap._created_default_heaps()),
                 "cuInit": fake.fakecuda_calls(b"cuInit"),
                 "retains": fake.fakecuda_calls(b"cuDevicePrimaryCtxRetain")}
    path, malloc_name, free_name = alloc.args
    lib = ctypes.CDLL(path)
    malloc = getattr(lib, malloc_name)
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, free_name)
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    p = malloc(3 << 20, 0, None)
    live = cuma.default_heap(0).stats()["active_allocs"]
    free(p, 3 << 20, 0, None)
    try:
        cuma.shutdown_default_heaps()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    print(json.dumps({"at_enable": at_enable, "refused": refused, "args": alloc.args, "swapped": swapped == [alloc], "hooks": sorted(alloc.cpp.hooks),
                      "wired": cuma.torch.wired_hooks(), "p": p, "live": live,
                      "after": cuma.default_heap(0).stats()["active_allocs"],
                      "backend": cuma.default_heap(0).stats()["backend"]}))
    """
)


def _fake_driver():
    build = os.path.dirname(os.path.dirname(_lib.path()))
    return os.path.join(build, "tests", "fakecuda", "libcuda.so.1")


def test_enable_hands_pytorch_the_raising_entry_point():
    driver = _fake_driver()
    if not os.path.exists(driver):
        pytest.skip("this build has no fake CUDA driver (no cuda.h when it was configured)")
    if not os.path.exists(os.path.join(os.path.dirname(_lib.path()), "libcuma_torch.so")):
        pytest.skip("this build has no libcuma_torch.so (no C++ compiler when it was configured)")
    env = dict(os.environ, CUMA_CUDA_LIBRARY=driver, FAKECUDA_CAPACITY="1G")
    env.pop("CUMA_CONF", None)
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    path, malloc_name, free_name = out["args"]
    lib_dir = os.path.dirname(_lib.path())
    assert path == os.path.join(lib_dir, "libcuma_torch.so")
    assert (malloc_name, free_name) == ("cuma_torch_raising_malloc", "cuma_torch_free")
    assert out["swapped"] and out["backend"] == "vmm"
    assert out["at_enable"] == {"heaps": [], "cuInit": 0, "retains": 0}, out["at_enable"]
    # PyTorch cannot be switched back: closing the heaps under it is refused.
    assert "cannot be switched back" in out["refused"], out["refused"]
    assert out["hooks"] == ["init_fn", "memory_fraction_fn", "record_stream_fn", "reset_fn"]
    assert sorted(out["wired"]) == out["hooks"]
    # The library PyTorch loads serves from the same default heap as the package's libcuma.
    assert out["p"] and out["live"] == 1 and out["after"] == 0


def test_without_the_raising_library_enable_warns_and_falls_back(tmp_path, monkeypatch):
    """A libcuma built without a C++ compiler: the plain entry point, and a warning that says
    what is lost."""
    monkeypatch.setattr(_lib, "path", lambda: str(tmp_path / "libcuma.so"))
    with pytest.warns(RuntimeWarning, match="libcuma_torch.so is missing"):
        path, name = cuma.torch._entry_points()
    assert (path, name) == (str(tmp_path / "libcuma.so"), "cuma_torch_malloc")


def _built_c10():
    """The libcuma_torch_c10-<torch version>.so of this build and its version, or skips."""
    lib_dir = os.path.dirname(_lib.path())
    found = sorted(f for f in os.listdir(lib_dir) if f.startswith("libcuma_torch_c10-") and f.endswith(".so"))
    if not found:
        pytest.skip("this build has no libcuma_torch_c10 (PyTorch's C++ headers were not found)")
    return os.path.join(lib_dir, found[0]), found[0][len("libcuma_torch_c10-") : -len(".so")]


def test_enable_prefers_the_c10_library_built_for_this_torch():
    """Under the PyTorch it was built for, PyTorch gets libcuma_torch_c10 (its own
    OutOfMemoryError type; test_torch_c10 checks the exception in C++), serving from the same
    default heap as the package."""
    driver = _fake_driver()
    if not os.path.exists(driver):
        pytest.skip("this build has no fake CUDA driver (no cuda.h when it was configured)")
    c10, version = _built_c10()
    env = dict(os.environ, CUMA_CUDA_LIBRARY=driver, FAKECUDA_CAPACITY="1G", STANDIN_TORCH_VERSION=version)
    env.pop("CUMA_CONF", None)
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert out["args"] == [c10, "cuma_torch_raising_malloc", "cuma_torch_free"]
    assert out["swapped"] and out["p"] and out["live"] == 1 and out["after"] == 0


def test_the_c10_library_is_built_for_the_torch_installed():
    """What CMake's probe saw is what this interpreter imports: the library is not dead weight."""
    _, version = _built_c10()
    torch = pytest.importorskip("torch")
    assert cuma.torch._entry_points(torch.__version__)[0].endswith("libcuma_torch_c10-%s.so" % version)


def test_a_c10_library_for_another_torch_is_never_loaded(tmp_path, monkeypatch, recwarn):
    """Its ABI is another PyTorch's: libcuma_torch.so instead, without a word."""
    (tmp_path / "libcuma_torch.so").write_bytes(b"")
    (tmp_path / "libcuma_torch_c10-1.13.0.so").write_bytes(b"not loaded: ctypes would fail on it")
    monkeypatch.setattr(_lib, "path", lambda: str(tmp_path / "libcuma.so"))
    path, name = cuma.torch._entry_points("2.5.1+cu121")
    assert (path, name) == (str(tmp_path / "libcuma_torch.so"), "cuma_torch_raising_malloc")
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_an_unloadable_c10_library_warns_and_falls_back(tmp_path, monkeypatch):
    (tmp_path / "libcuma_torch.so").write_bytes(b"")
    (tmp_path / "libcuma_torch_c10-2.5.1.so").write_bytes(b"not an ELF file")
    monkeypatch.setattr(_lib, "path", lambda: str(tmp_path / "libcuma.so"))
    with pytest.warns(RuntimeWarning, match="cannot be loaded.*not torch.cuda.OutOfMemoryError"):
        path, name = cuma.torch._entry_points("2.5.1")
    assert (path, name) == (str(tmp_path / "libcuma_torch.so"), "cuma_torch_raising_malloc")


def test_an_unloadable_c10_library_is_built_again_for_this_torch(tmp_path, monkeypatch):
    """Built for this version, but not loadable here (another C++ ABI, say): one built at run
    time against the PyTorch that is there is tried before the plain RuntimeError library (it
    used to go straight to that one)."""
    from cuma import _torch_c10

    (tmp_path / "libcuma_torch.so").write_bytes(b"")
    (tmp_path / "libcuma_torch_c10-2.5.1.so").write_bytes(b"not an ELF file")
    monkeypatch.setattr(_lib, "path", lambda: str(tmp_path / "libcuma.so"))
    calls = []
    libc = ctypes.util.find_library("c")

    def build(torch, lib_path):
        calls.append(lib_path)
        return libc  # a library that loads, standing in for one built against this PyTorch

    monkeypatch.setattr(_torch_c10, "library", build)
    path, name = cuma.torch._entry_points("2.5.1", torch=object())
    assert calls == [str(tmp_path / "libcuma.so")]
    assert (path, name) == (libc, "cuma_torch_raising_malloc")


def _real_torch_with_headers():
    torch = pytest.importorskip("torch")
    root = os.path.dirname(torch.__file__)
    if not os.path.isfile(os.path.join(root, "include", "c10", "util", "Exception.h")):
        pytest.skip("this PyTorch has no C++ headers (Debian: libtorch-dev)")
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no C++ compiler")
    return torch


def test_run_time_build_for_a_torch_libcuma_was_not_built_against(tmp_path, monkeypatch):
    """A pip user's PyTorch: built once into the cache, found there the next time, picked by
    enable()'s _entry_points, and raising PyTorch's type (checked by test_torch_c10 in C++)."""
    torch = _real_torch_with_headers()
    from cuma import _torch_c10

    monkeypatch.setenv("CUMA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUMA_TORCH_C10_BUILD", raising=False)
    libcuma = _lib.path()
    built = _torch_c10.library(torch, libcuma)
    assert built and os.path.dirname(built) == str(tmp_path / "cache"), os.listdir(tmp_path / "cache")
    assert os.path.basename(built).startswith("libcuma_torch_c10-%s-" % torch.__version__)
    mtime = os.stat(built).st_mtime_ns
    assert _torch_c10.library(torch, libcuma) == built and os.stat(built).st_mtime_ns == mtime
    # Where libcuma has none for this version, _entry_points takes the built one.
    other = tmp_path / "lib"
    other.mkdir()
    (other / "libcuma_torch.so").write_bytes(b"")
    monkeypatch.setattr(_lib, "path", lambda: str(other / "libcuma.so"))
    monkeypatch.setattr(_torch_c10, "library", lambda t, p: built)
    assert cuma.torch._entry_points(torch.__version__, torch) == (built, "cuma_torch_raising_malloc")
    test = os.path.join(os.path.dirname(os.path.dirname(libcuma)), "tests", "torch", "test_torch_c10")
    if os.path.exists(test):
        env = dict(os.environ, CUMA_CONF="backend:sim,capacity:64M")
        r = subprocess.run([test, built, torch.__version__], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_run_time_build_without_a_compiler_is_silently_skipped(tmp_path, monkeypatch, recwarn):
    torch = _real_torch_with_headers()
    from cuma import _torch_c10

    monkeypatch.setenv("CUMA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert _torch_c10.library(torch, _lib.path()) is None
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("CUMA_TORCH_C10_BUILD", "0")
    assert _torch_c10.library(torch, _lib.path()) is None
    assert not os.path.exists(tmp_path / "cache") and not recwarn.list


def test_a_failed_run_time_build_is_not_retried(tmp_path, monkeypatch):
    """A compiler that fails: its output is kept beside the library's name, and the next call
    does not run it again."""
    torch = _real_torch_with_headers()
    from cuma import _torch_c10

    calls = tmp_path / "calls"
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho run >> %s\necho 'cxx: broken' >&2\nexit 1\n" % calls)
    fake.chmod(0o755)
    monkeypatch.setenv("CUMA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.delenv("CUMA_TORCH_C10_BUILD", raising=False)
    assert _torch_c10.library(torch, _lib.path()) is None
    assert _torch_c10.library(torch, _lib.path()) is None
    assert calls.read_text() == "run\n"
    failed = [f for f in os.listdir(tmp_path / "cache") if f.endswith(".failed")]
    assert len(failed) == 1 and b"cxx: broken" in (tmp_path / "cache" / failed[0]).read_bytes()
    assert [f for f in os.listdir(tmp_path / "cache") if not f.endswith(".failed")] == []
