#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What `make install` gives a user, checked in a scratch prefix: a C program built with
# pkg-config and one built with CMake's find_package(cuma) run against the installed library; the
# installed `cuma` command runs; the installed Python package imports and finds the installed
# library by itself (no CUMA_LIBRARY, no PYTHONPATH into the source tree, run from elsewhere).
#
# The package's folder under the configured prefix must also be on that interpreter's own path,
# so that after a real `make install` nothing needs setting (checked without installing there).
#
# usage: check_install.sh BUILD_DIR PYTHON_DIR PREFIX PYTHON
#        (PYTHON_DIR relative to the prefix, empty: no package; PREFIX: the configured one)
set -euo pipefail
build=$1
pydir=${2:-}
conf_prefix=${3:-/usr/local}
python=${4:-/usr/bin/python3}
tmp=$(mktemp -d /tmp/cuma-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "check_install: FAIL: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "cmake --install"; }
for f in include/cuma/cuma.h include/cuma/ledger.h bin/cuma; do
  [ -e "$prefix/$f" ] || fail "$f was not installed"
done
libdir=$(cd "$prefix" && ls -d lib* | head -1)
[ -e "$prefix/$libdir/libcuma.so" ] || fail "libcuma.so is not in $prefix/$libdir"

cat >"$tmp/use.c" <<'C'
#include <cuma/cuma.h>
#include <stdio.h>
int main(void) {
    cuma_config c = {.conf = "backend:sim,capacity:256M"};
    cuma_heap *h;
    void *p;
    if (cuma_heap_create(&c, &h) || cuma_alloc(h, 1 << 20, 0, &p) || cuma_free(h, p, 0)) {
        fprintf(stderr, "%s\n", cuma_last_error());
        return 1;
    }
    cuma_stats s;
    cuma_get_stats(h, &s);
    printf("allocs %llu\n", (unsigned long long)s.num_allocs);
    cuma_heap_destroy(h);
    return 0;
}
C
# pkg-config
flags=$(PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig" pkg-config --cflags --libs cuma) || fail "pkg-config cuma"
cc -std=c11 -Wall -Werror "$tmp/use.c" $flags -Wl,-rpath,"$prefix/$libdir" -o "$tmp/use_pc"
[ "$("$tmp/use_pc")" = "allocs 1" ] || fail "the pkg-config build did not allocate"
# Not `ldd | grep -q`: under pipefail, grep's early exit makes ldd die of SIGPIPE now and then.
libs=$(ldd "$tmp/use_pc")
case "$libs" in
  *"$prefix/$libdir/libcuma.so"*) ;;
  *) fail "the pkg-config build did not load the installed libcuma.so: $libs" ;;
esac

# CMake package
mkdir "$tmp/proj"
cp "$tmp/use.c" "$tmp/proj/"
cat >"$tmp/proj/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.16)
project(use C)
find_package(cuma REQUIRED)
add_executable(use use.c)
target_link_libraries(use PRIVATE cuma::cuma)
CM
cmake -S "$tmp/proj" -B "$tmp/proj/b" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log"; fail "find_package(cuma)"; }
cmake --build "$tmp/proj/b" >"$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log"; fail "building with cuma::cuma"; }
[ "$("$tmp/proj/b/use")" = "allocs 1" ] || fail "the find_package build did not allocate"

# The command
"$prefix/bin/cuma" version >/dev/null || fail "the installed cuma command does not run"

# Python
if [ -n "$pydir" ]; then
  [ -f "$prefix/$pydir/cuma/__init__.py" ] || fail "the Python package is not in $prefix/$pydir"
  [ -f "$prefix/$pydir/cuma/_installed.py" ] || fail "the Python package has no _installed.py"
  got=$(cd "$tmp" && env -u CUMA_LIBRARY -u CUMA_CONF PYTHONPATH="$prefix/$pydir" PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -c '
import cuma, cuma._lib
h = cuma.Heap("backend:sim,capacity:256M", use_env=False)
h.free(h.alloc(1 << 20))
print(h.stats()["num_allocs"], cuma._lib.lib()._name)
') || fail "import cuma from the installed package"
  case "$got" in
    "1 $prefix/"*) ;;
    *) fail "the installed package loaded another library or did not allocate: '$got'" ;;
  esac
  case "$conf_prefix" in
    /usr | /usr/local)
      "$python" -c 'import os, sys; sys.exit(os.path.join(sys.argv[1], sys.argv[2]) not in sys.path)' \
        "$conf_prefix" "$pydir" ||
        fail "$conf_prefix/$pydir is not on $python's path: set CUMA_PYTHON_DIR" ;;
    *) echo "check_install: prefix $conf_prefix is not the system's: its Python folder needs PYTHONPATH" ;;
  esac
fi
echo "check_install: pkg-config, find_package(cuma), the cuma command${pydir:+ and the Python package ($pydir)} work from $prefix"
