"""cuma.torch.enable() refuses clearly where it cannot work (Debian's torch 1.13 is a CPU
build without CUDAPluggableAllocator), and the package loads lazily."""

import os
import shutil
import subprocess
import sys

import pytest

import cuma

torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a PyTorch without CUDA")
def test_enable_on_cpu_torch_says_exactly_why():
    with pytest.raises(RuntimeError) as ei:
        cuma.torch.enable()
    msg = str(ei.value)
    assert "built without CUDA" in msg
    if not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        assert "CUDAPluggableAllocator" in msg and torch.__version__ in msg
    assert not cuma.torch.is_enabled()
    assert os.environ.get("CUMA_CONF") is None  # nothing was changed on the way out
    with pytest.raises(RuntimeError, match="built without CUDA"):
        cuma.CudaMemoryAllocator("limit:1G").install()


def test_empty_cache_without_torch_allocator(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    h = cuma.default_heap(0)
    h.free(h.alloc(8 << 20))
    assert h.stats()["reserved_bytes"] == 8 << 20
    cuma.torch.empty_cache()
    assert h.stats()["reserved_bytes"] == 0


def test_import_without_library_fails_lazily_and_says_where_it_looked(tmp_path):
    """A copy of the package with no libcuma anywhere: import works, first use raises
    LibraryNotFoundError naming each place tried."""
    pkg = os.path.dirname(cuma.__file__)
    shutil.copytree(pkg, str(tmp_path / "cuma"), ignore=shutil.ignore_patterns("__pycache__", "*.so*"))
    code = (
        "import cuma\n"
        "try:\n"
        "    cuma.Heap('backend:sim')\n"
        "except cuma.LibraryNotFoundError as e:\n"
        "    print('LNF', e)\n"
    )
    env = dict(os.environ, CUMA_LIBRARY=str(tmp_path / "missing" / "libcuma.so"), PYTHONPATH=str(tmp_path))
    env.pop("LD_LIBRARY_PATH", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("LNF libcuma.so not found")
    assert "$CUMA_LIBRARY: %s" % (tmp_path / "missing" / "libcuma.so") in text
    assert str(tmp_path / "cuma" / "libcuma.so") in text
    assert "source tree build" in text


def test_library_next_to_the_package_is_found(tmp_path):
    pkg = os.path.dirname(cuma.__file__)
    shutil.copytree(pkg, str(tmp_path / "cuma"), ignore=shutil.ignore_patterns("__pycache__", "*.so*"))
    shutil.copy(cuma.library_path(), str(tmp_path / "libcuma.so"))
    code = "import cuma; print(cuma.library_path()); cuma.Heap('backend:sim').close()"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("CUMA_LIBRARY", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "libcuma.so")
