# SPDX-License-Identifier: Apache-2.0
"""The one list of statistics (CUMA_STATS_FIELDS in cuma.h; cuma_stat_fields at run time) and
every surface that shows its figures: Heap.stats() (cuma_stats_json), a cuma.ledger() entry (its
ctypes layout), `cuma stats --json` and `cuma exporter`. Each figure appears on each of its
surfaces under its one name, and no surface has a figure the list lacks, so a figure added to
one surface by hand, and not to the list, fails here."""

import json
import os
import subprocess
import time

import pytest

import cuma
from cuma import _lib

MB = 1 << 20

# What Heap.stats() holds besides the figures: the heap's description and settings.
STATS_META = {"version", "mode", "backend", "backend_fallback", "page_alias", "device", "policy",
              "ledger", "ledger_error", "trace_error", "config"}
# cuma_ledger_entry's fields that are the ledger's own (its slot, admission, pressure, ages).
LEDGER_OWN = {"pid", "priority", "slot", "process", "device", "capacity", "guarantee", "limit",
              "reserved", "cached", "requested", "peak_reserved", "want", "ledger_denials",
              "pressure_asks", "pressure_given_bytes", "pressure_callbacks", "age_ns", "backend",
              "stats_age_ns", "pod", "pod_namespace", "container"}
# `cuma exporter`'s families that are not figures of the list: the scrape's own, the devices',
# the ledger's own of each heap, the figures' ages, and stranded bytes, which it derives from
# mapped_bytes and fragmentation.
EXPORTER_OWN = {
    "cuma_ledger_up", "cuma_exporter_scrape_errors_total", "cuma_exporter_reads_total",
    "cuma_ledger_stale",
    "cuma_ledger_snapshot_age_seconds", "cuma_ledger_unlocked", "cuma_ledger_lock_stuck_seconds",
    "cuma_device_capacity_bytes", "cuma_device_reserved_bytes", "cuma_device_cached_bytes",
    "cuma_device_guaranteed_bytes", "cuma_device_free_bytes", "cuma_device_heaps",
    "cuma_reserved_bytes", "cuma_cached_bytes", "cuma_requested_bytes", "cuma_guarantee_bytes",
    "cuma_limit_bytes", "cuma_peak_reserved_bytes", "cuma_pressure_want_bytes",
    "cuma_ledger_denials_total", "cuma_pressure_asks_total", "cuma_pressure_given_bytes_total",
    "cuma_pressure_callbacks_total", "cuma_heap_publish_age_seconds",
    "cuma_heap_stats_age_seconds", "cuma_stranded_bytes",
}


def family(f):
    """A figure's exporter family: cuma_NAME, _total after a counter, _ratio after a ratio."""
    suffix = "_total" if f["kind"] == "counter" else "_ratio" if f["unit"] == "ratio" else ""
    return "cuma_" + f["name"] + suffix


def cuma_cli():
    """build/bin/cuma next to the libcuma.so the tests load (scripts/pytest.sh sets it)."""
    lib = os.environ.get("CUMA_LIBRARY")
    if not lib:
        pytest.skip("CUMA_LIBRARY is not set (run through scripts/pytest.sh)")
    cli = os.path.join(os.path.dirname(os.path.dirname(lib)), "bin", "cuma")
    assert os.path.exists(cli), "no %s next to the library under test" % cli
    return cli


def test_the_list_names_each_figure_once_with_a_kind_and_help():
    fields = _lib.stat_fields()
    names = [f["name"] for f in fields]
    assert len(names) == len(set(names)) and len(names) > 40
    for f in fields:
        assert f["help"] and f["kind"] in ("gauge", "counter"), f
        assert f["unit"] != "bytes" or f["name"].endswith("_bytes") or f["name"] == "page_size", f
        assert not f["exported"] or f["ledger"], f  # the exporter reads the ledger
        assert not f["exported"] or f["unit"] != "ns", f  # Prometheus wants seconds
    words = [f for f in fields if f["ledger"]]
    assert len({f["ledger_offset"] for f in words}) == len(words)


def test_stats_json_holds_the_list_and_nothing_else(sim_heap):
    fields = _lib.stat_fields()
    s = sim_heap.stats()
    # ledger_room_bytes is unknown (UINT64_MAX) outside a ledger: the JSON leaves it out.
    assert set(s) - STATS_META == {f["name"] for f in fields} - {"ledger_room_bytes"}
    for f in fields:
        if f["name"] in s:
            assert isinstance(s[f["name"]], float if f["unit"] == "ratio" else int), f


def test_ledger_entry_layout_is_the_lists():
    """The ctypes cuma_ledger_entry has each ledger figure at the library's offset, under its
    name, and no figure besides the ledger's own fields."""
    ledger = {f["name"]: f for f in _lib.stat_fields() if f["ledger"]}
    names = [n for n, _ in _lib.LedgerEntry._fields_]
    for name, f in ledger.items():
        assert name in names and getattr(_lib.LedgerEntry, name).offset == f["ledger_offset"], f
    assert set(names) - set(ledger) == LEDGER_OWN


@pytest.fixture
def ledger_name():
    name = "pytest-fields-%d" % os.getpid()
    yield name
    try:
        os.remove(cuma.ledger_path(name))
    except FileNotFoundError:
        pass


def test_every_surface_shows_the_lists_figures_by_name(ledger_name):
    fields = _lib.stat_fields()
    ledger = [f for f in fields if f["ledger"]]
    with cuma.Heap("backend:sim,capacity:64M,page_size:1M,tcache:off,arenas:1,"
                   "release_delay_ms:100000,ledger:%s" % ledger_name, use_env=False) as h:
        blocks = [h.alloc((i + 1) * 300 * 1024) for i in range(5)]
        h.free(blocks[1])
        s = h.stats()
        assert "ledger_room_bytes" in s and set(s) - STATS_META == {f["name"] for f in fields}
        deadline = time.monotonic() + 30  # a bound on a hang: it publishes every 100 ms
        while True:
            e = cuma.ledger(ledger_name)[0]
            if e["stats_age_ns"] is not None and e["num_frees"] == s["num_frees"]:
                break
            assert time.monotonic() < deadline, "figures not published within 30 s: %r" % e
            time.sleep(0.02)
        for f in ledger:
            want = s[f["name"]]
            if f["unit"] == "ratio":  # the ledger keeps parts per million
                assert e[f["name"]] == pytest.approx(want, abs=1e-6), f
            else:
                assert e[f["name"]] == want, f

        cli = cuma_cli()
        out = subprocess.run([cli, "stats", "--json", "--ledger", ledger_name], check=True,
                             stdout=subprocess.PIPE, universal_newlines=True, timeout=60).stdout
        heaps = [x for d in json.loads(out)["devices"] for x in d["heaps"]]
        assert len(heaps) == 1
        for f in ledger:
            assert heaps[0][f["name"]] == pytest.approx(e[f["name"]], abs=1e-6), f

        text = subprocess.run([cli, "exporter", "--once", "--ledger", ledger_name], check=True,
                              stdout=subprocess.PIPE, universal_newlines=True,
                              timeout=60).stdout
        for b in blocks[:1] + blocks[2:]:
            h.free(b)
    helps, types, sampled = {}, {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            types[name] = typ
        elif line:
            sampled.add(line.split("{")[0].split(" ")[0])
    exported = {family(f): f for f in fields if f["exported"]}
    for fam, f in exported.items():
        assert helps.get(fam) == f["help"] and types.get(fam) == f["kind"], (fam, f)
        assert fam in sampled, fam
    assert set(types) - set(exported) == EXPORTER_OWN
