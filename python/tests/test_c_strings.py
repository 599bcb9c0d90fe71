# SPDX-License-Identifier: Apache-2.0
"""Strings handed to C: a NUL inside one would end it there for C ("limit:1M\\0junk" read as
"limit:1M"), and numbers that strtod takes but no setting documents (hex floats) are refused."""

import pytest

import cuma

CONF_CALLS = [
    ("Heap", lambda conf: cuma.Heap(conf, use_env=False).close()),
    ("check_config", cuma.check_config),
    ("CudaMemoryAllocator", lambda conf: cuma.CudaMemoryAllocator(conf).allocate(4096)),
]


@pytest.mark.parametrize("who,call", CONF_CALLS, ids=[c[0] for c in CONF_CALLS])
def test_nul_in_settings_is_refused_naming_the_argument(who, call):
    with pytest.raises(cuma.ConfigError, match=r"%s: conf contains a NUL character \(at byte 33\)" % who):
        call("backend:sim,capacity:64M,limit:1M\x00junk")
    assert not cuma.heap._created_default_heaps()  # nothing was made from the cut string


@pytest.mark.parametrize(
    "call,name",
    [(cuma.ledger, "ledger: name"), (cuma.ledger_path, "ledger_path: name")],
)
def test_nul_in_a_ledger_name_is_refused(call, name):
    with pytest.raises(ValueError, match="%s contains a NUL character" % name):
        call("jobs\x00other")


@pytest.mark.parametrize(
    "conf,key",
    [
        ("limit:0x1p30", "limit"),
        ("capacity:0x40000000", "capacity"),
        ("capacity:1e9", "capacity"),
        ("limit:+1G", "limit"),
        ("memory_fraction:0x0.8p0", "memory_fraction"),
        ("memory_fraction:inf", "memory_fraction"),
        ("release_delay_ms:+5", "release_delay_ms"),
        ("priority:--1", "priority"),
    ],
)
def test_numbers_no_setting_documents_are_refused(conf, key):
    with pytest.raises(cuma.ConfigError, match="key '%s'" % key):
        cuma.check_config(conf)
    with pytest.raises(cuma.ConfigError, match="key '%s'" % key):
        cuma.Heap("backend:sim,capacity:64M," + conf, use_env=False)


def test_documented_forms_still_read():
    with cuma.Heap("backend:sim,capacity:1.5G,limit:1GiB,memory_fraction:.5,page_call_budget:1e-3",
                   use_env=False) as h:
        c = h.stats()["config"]
        assert c["capacity"] == 3 << 29 and c["limit"] == 1 << 30
