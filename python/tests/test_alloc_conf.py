# SPDX-License-Identifier: Apache-2.0
"""PYTORCH_CUDA_ALLOC_CONF under cuma.torch.enable(): options with a cuma equivalent become cuma
settings, the others warn. enable() runs against a stand-in for a CUDA build of PyTorch; the
default heap is simulated here, so enable() stops at its refusal of the simulated device, after
the settings were applied, which is what these tests look at."""

import os
import sys
import types
import warnings

import pytest

import cuma
from cuma import _alloc_conf


def test_translate_maps_what_has_an_equivalent():
    settings, notes = _alloc_conf.translate(
        "expandable_segments:True, per_process_memory_fraction:0.5,backend:native,pinned_num_register_threads:8"
    )
    assert settings == ["memory_fraction:0.5"]
    assert notes == []


@pytest.mark.parametrize(
    "option, says",
    [
        ("garbage_collection_threshold:0.8", "release_delay_ms"),
        ("max_split_size_mb:128", "do not fragment"),
        ("roundup_power2_divisions:4", "round sizes"),
        # A list value: one option, whose commas are inside the brackets (they gave two more
        # notes, "512:2" and ">:8]" as options cuma did not know).
        ("roundup_power2_divisions:[256:1,512:2,>:8]", "round sizes"),
        ("backend:cudaMallocAsync", "stream-ordered"),
        ("per_process_memory_fraction:1.5", "not a fraction"),
        ("no_such_option:1", "not an option cuma knows"),
        ("stream_order:off", "CUMA_CONF"),
    ],
)
def test_translate_says_why_an_option_is_ignored(option, says):
    settings, notes = _alloc_conf.translate(option)
    assert settings == []
    assert len(notes) == 1 and says in notes[0] and option.split(":")[0] in notes[0]


def test_the_callers_settings_win():
    assert _alloc_conf.merge(["memory_fraction:0.5"], "limit:1G") == "memory_fraction:0.5,limit:1G"
    assert _alloc_conf.merge(["memory_fraction:0.5"], "memory_fraction:0.25,limit:1G") == "memory_fraction:0.25,limit:1G"
    assert _alloc_conf.merge([], None) is None


class _Pluggable:
    def __init__(self, path, malloc_name, free_name):
        self.args = (path, malloc_name, free_name)


@pytest.fixture
def enabled_state(fresh_default_heaps):
    """For tests whose enable() succeeds (a stand-in torch makes no heap): PyTorch's switch
    undone before the default heaps are shut down (which refuses under it)."""
    yield
    cuma.torch._allocator = None
    cuma.torch._conf_at_enable = None
    cuma.torch._hooks = []
    cuma.heap._settings_fixed_by = None


def _stand_in_torch(monkeypatch, initialized=False):
    memory = types.SimpleNamespace(CUDAPluggableAllocator=_Pluggable, change_current_allocator=lambda a: None)
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0+stand-in"
    torch.version = types.SimpleNamespace(cuda="13.0", hip=None)
    torch.cuda = types.SimpleNamespace(memory=memory, is_initialized=lambda: initialized)
    monkeypatch.setitem(sys.modules, "torch", torch)


def _isolate_cuma_conf(monkeypatch):
    # enable() must leave CUMA_CONF alone (it gives the default heaps settings of their own).
    monkeypatch.setenv("CUMA_CONF", "")
    monkeypatch.delenv("CUMA_CONF")


def _setting(key):
    """What the default heaps will be made with (enable() makes none)."""
    return cuma.heap._conf_value(cuma.heap._default_conf(), key)


def test_enable_applies_the_translated_settings_and_warns(monkeypatch, enabled_state):
    _stand_in_torch(monkeypatch)
    _isolate_cuma_conf(monkeypatch)
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,per_process_memory_fraction:0.5,max_split_size_mb:64"
    )
    with pytest.warns(RuntimeWarning, match="max_split_size_mb is not needed") as rec:
        cuma.torch.enable("limit:1G")
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning) and "max_split" in str(w.message)]) == 1
    assert "CUMA_CONF" not in os.environ
    assert _setting("memory_fraction") == 0.5 and _setting("limit") == 1 << 30
    assert cuma.heap._created_default_heaps() == {}


def test_a_refused_enable_leaves_the_settings_as_they_were(monkeypatch):
    """The simulated device is refused before anything is set (the translated settings, with
    stream_order:on, used to stay for every default heap made later)."""
    _stand_in_torch(monkeypatch)
    _isolate_cuma_conf(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.5")
    with pytest.raises(RuntimeError, match="simulated device"):
        cuma.torch.enable("backend:sim,capacity:1G")
    assert cuma.heap._default_conf() is None and cuma.heap._settings_fixed_by is None
    assert not cuma.torch.is_enabled() and cuma.heap._created_default_heaps() == {}


def test_enable_after_cuda_init_leaves_nothing_behind(monkeypatch):
    """PyTorch initialises its allocator with CUDA and then refuses to swap it, whatever it has
    allocated: enable() refuses first, before it sets settings or makes a heap (it used to make
    device 0's, with any preallocation, and leave it behind the refusal)."""
    _stand_in_torch(monkeypatch, initialized=True)
    _isolate_cuma_conf(monkeypatch)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(RuntimeError, match="initialised already"):
        cuma.torch.enable("backend:sim,capacity:64M,preallocate:32M")
    assert cuma.heap._created_default_heaps() == {}
    assert cuma.heap._default_conf() is None
    assert cuma.torch.wired_hooks() == [] and not cuma.torch.is_enabled()


def test_enable_keeps_cuma_conf_settings_over_translated_ones(monkeypatch, enabled_state):
    _stand_in_torch(monkeypatch)
    _isolate_cuma_conf(monkeypatch)
    monkeypatch.setenv("CUMA_CONF", "limit:1G,memory_fraction:0.25")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here deserves a warning
        warnings.filterwarnings("ignore", message=".*libcuma_torch.*")  # which library: not this test's
        cuma.torch.enable()
    assert _setting("memory_fraction") == 0.25


def test_enable_without_the_variable_changes_nothing(monkeypatch, enabled_state):
    _stand_in_torch(monkeypatch)
    _isolate_cuma_conf(monkeypatch)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuma.torch.enable("limit:1G")
    assert "CUMA_CONF" not in os.environ
    assert _setting("limit") == 1 << 30
    assert _setting("memory_fraction") == cuma.heap._conf_value(None, "memory_fraction")  # the default


def test_torch_defaults_go_under_the_callers_settings():
    env = {}
    assert _alloc_conf.apply(env, "limit:1G") == "stream_order:on,limit:1G"
    assert _alloc_conf.apply(env, None) == "stream_order:on"
    assert _alloc_conf.apply(env, "stream_order:off") == "stream_order:off"
    assert _alloc_conf.apply({"CUMA_CONF": "stream_order:off,limit:1G"}, None) is None
    assert _alloc_conf.apply({"CUMA_CONF": "limit:1G"}, None) == "stream_order:on,limit:1G"
    assert _alloc_conf.apply(env, "limit:1G", defaults=()) == "limit:1G"


def test_enable_orders_streams_unless_told_otherwise(monkeypatch, enabled_state):
    # PyTorch's memory is used on its allocation stream (record_stream for others), so the
    # default heaps enable() makes share another stream's pending pages, ordered on the device.
    _stand_in_torch(monkeypatch)
    _isolate_cuma_conf(monkeypatch)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuma.torch.enable("limit:1G")
    assert _setting("stream_order") is True
    # Fixed: other settings for the default heaps are refused from now on.
    with pytest.raises(RuntimeError, match="fixed"):
        cuma.adaptive.set_memory_growth(True)

