# SPDX-License-Identifier: Apache-2.0
"""cuma.torch.enable() as far as it can go without a GPU: a stand-in for a CUDA build of
PyTorch 2.x records what enable() hands to CUDAPluggableAllocator, and the default heap is on
the fake CUDA driver (tests/fakecuda), so the path that refuses the simulated device is passed.
What PyTorch would load is then loaded and called the way PyTorch calls it (ctypes here: a
successful allocation and its free; test_torch_raise and test_torch_c10 cover the exceptions
in C++). Which library enable() picks (libcuma_torch_c10 for the PyTorch it was built for,
else libcuma_torch.so) is checked here too."""

import ctypes
import os
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
    print(json.dumps({"args": alloc.args, "swapped": swapped == [alloc], "hooks": sorted(alloc.cpp.hooks),
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
