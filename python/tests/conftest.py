# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: every test starts with no default heaps, no CUMA_CONF and no settings given
to the default heaps, and leaves none behind, since the default heaps are process-wide and read
those when created."""

import pytest

import cuma
import cuma.heap
from cuma import _lib


def _forget_default_settings():
    with cuma.heap._conf_lock:
        cuma.heap._set_default_settings(None)
        cuma.heap._settings_fixed_by = None


@pytest.fixture(autouse=True)
def fresh_default_heaps(monkeypatch):
    monkeypatch.delenv("CUMA_CONF", raising=False)
    cuma.shutdown_default_heaps()
    _forget_default_settings()
    yield
    cuma.shutdown_default_heaps()
    _forget_default_settings()


@pytest.fixture
def lib():
    """The loaded libcuma (ctypes), for calling the C entry points directly."""
    return _lib.lib()


@pytest.fixture
def sim_heap():
    with cuma.Heap("backend:sim,capacity:64M,page_size:2M", use_env=False) as h:
        yield h


MB = 1 << 20

_driver = None


def cuda_driver_present():
    """Whether backend:auto gets a real device here (a CUDA driver and libcuma's CUDA
    backends). Without one, the default heaps fall back to the simulated device."""
    global _driver
    if _driver is None:
        try:
            cuma.Heap("backend:auto", use_env=False).close()
            _driver = True
        except cuma.NoDeviceError:
            _driver = False
    return _driver
