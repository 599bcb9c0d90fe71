# SPDX-License-Identifier: Apache-2.0
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


def _package_copy(tmp_path):
    """A copy of the package alone (no libcuma in it), importable from tmp_path."""
    pkg = os.path.dirname(cuma.__file__)
    shutil.copytree(pkg, str(tmp_path / "cuma"), ignore=shutil.ignore_patterns("__pycache__", "*.so*"))


def _run_copy(tmp_path, code, **env_changes):
    """Runs code with the copy of the package, from tmp_path (not the source tree, whose
    cuma/ would shadow the copy when the tests run from python/)."""
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("LD_LIBRARY_PATH", None)
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120
    )


LOAD_AND_REPORT = (
    "import cuma\n"
    "try:\n"
    "    cuma.Heap('backend:sim')\n"
    "    print('LOADED', cuma.library_path())\n"
    "except cuma.LibraryNotFoundError as e:\n"
    "    print('LNF', e)\n"
)


def test_import_without_library_fails_lazily_and_says_where_it_looked(tmp_path):
    """A copy of the package with no libcuma anywhere: import works, first use raises
    LibraryNotFoundError naming each place tried."""
    _package_copy(tmp_path)
    out = _run_copy(tmp_path, LOAD_AND_REPORT, CUMA_LIBRARY=None)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("LNF libcuma.so not found")
    assert str(tmp_path / "cuma" / "libcuma.so") in text
    assert "source tree build" in text and "dynamic loader search" in text


def test_cuma_library_that_cannot_be_used_is_an_error_not_a_fallthrough(tmp_path):
    """An explicit CUMA_LIBRARY wins over copies found elsewhere, also when it is wrong: the
    error names the setting and why, though a good library lies next to the package."""
    _package_copy(tmp_path)
    shutil.copy(cuma.library_path(), str(tmp_path / "libcuma.so"))
    missing = tmp_path / "missing" / "libcuma.so"
    out = _run_copy(tmp_path, LOAD_AND_REPORT, CUMA_LIBRARY=str(missing))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("LNF CUMA_LIBRARY=%s names no usable libcuma" % missing), out.stdout
    assert "$CUMA_LIBRARY: %s (no such file)" % missing in out.stdout
    assert "next to the package" not in out.stdout  # nothing else was tried

    junk = tmp_path / "junk.so"
    junk.write_text("not a library\n")
    out = _run_copy(tmp_path, LOAD_AND_REPORT, CUMA_LIBRARY=str(junk))
    assert out.stdout.startswith("LNF CUMA_LIBRARY=%s" % junk) and "$CUMA_LIBRARY: %s (" % junk in out.stdout

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    out = _run_copy(tmp_path, LOAD_AND_REPORT, CUMA_LIBRARY=str(empty_dir))
    assert out.stdout.startswith("LNF CUMA_LIBRARY=%s" % empty_dir)
    assert "$CUMA_LIBRARY directory: %s (no such file)" % (empty_dir / "libcuma.so") in out.stdout

    out = _run_copy(tmp_path, LOAD_AND_REPORT, CUMA_LIBRARY=str(tmp_path))  # a folder holding one
    assert out.stdout.strip() == "LOADED %s" % (tmp_path / "libcuma.so"), out.stdout + out.stderr


def test_library_next_to_the_package_is_found(tmp_path):
    _package_copy(tmp_path)
    shutil.copy(cuma.library_path(), str(tmp_path / "libcuma.so"))
    code = "import cuma; print(cuma.library_path()); cuma.Heap('backend:sim').close()"
    out = _run_copy(tmp_path, code, CUMA_LIBRARY=None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "libcuma.so")
