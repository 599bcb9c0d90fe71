#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What CI checks of the Python packaging, on a clean clone of the repository's HEAD (what CI
# has; PIP_CHECK_WORKTREE=1 copies the working tree's tracked and unignored files instead):
#   /usr/bin/python3 -m venv --system-site-packages v
#   v/bin/pip install --no-index --no-build-isolation .      (and pip wheel the same way)
# then, from a directory outside the source: `v/bin/cuma version`, `import cuma` from the venv
# with its bundled library (CUMA_LIBRARY unset), a simulated heap, the metadata version, and a
# few of the package's tests (test_heap.py, test_snapshot.py) against the installed copy.
# Everything happens in a temporary directory, removed at the end. Exits non-zero on failure.
# usage: scripts/pip-check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuma-pip-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
unset CUMA_LIBRARY CUMA_CONF PYTHONPATH
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
step() { echo "== pip-check: $*"; }
fail() { echo "pip-check: FAILED: $*" >&2; exit 1; }

if [ "${PIP_CHECK_WORKTREE:-0}" = 1 ]; then
  step "copying the working tree"
  mkdir "$tmp/src"
  (cd "$root" && git ls-files -z --cached --others --exclude-standard |
    xargs -0 -I{} sh -c 'test -e "{}" && echo "{}"' | tar -cf - -T -) | tar -xf - -C "$tmp/src"
else
  step "cloning HEAD ($(git -C "$root" rev-parse --short HEAD))"
  git clone -q --no-hardlinks "$root" "$tmp/src"
  [ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] ||
    echo "pip-check: note: uncommitted changes are not in the clone (PIP_CHECK_WORKTREE=1 checks them)"
fi

step "venv + pip install --no-index --no-build-isolation ."
/usr/bin/python3 -m venv --system-site-packages "$tmp/v"
(cd "$tmp/src" && "$tmp/v/bin/pip" install -q --no-build-isolation .) || fail "pip install ."

step "pip wheel --no-index --no-build-isolation ."
(cd "$tmp/src" && "$tmp/v/bin/pip" wheel -q --no-deps --no-build-isolation -w "$tmp/wheels" .) ||
  fail "pip wheel ."
whl=$(ls "$tmp"/wheels/cuma-*.whl)
/usr/bin/python3 - "$whl" <<'PY' || fail "the wheel lacks files"
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = ["cuma/__init__.py", "cuma/libcuma.so.0", "cuma/libcuma_preload.so", "cuma/bin/cuma"]
missing = [n for n in want if n not in names]
print("  wheel %s: %d files%s" % (sys.argv[1].rsplit("/", 1)[-1], len(names),
                                  ", missing " + " ".join(missing) if missing else ""))
sys.exit(1 if missing else 0)
PY

mkdir "$tmp/elsewhere"
cd "$tmp/elsewhere"
step "cuma version (console entry point)"
out=$("$tmp/v/bin/cuma" version) || fail "cuma version"
echo "  $out"
step "import cuma from the venv, a simulated heap"
"$tmp/v/bin/python" - "$tmp/v" "$tmp/src" <<'PY' || fail "import cuma"
import importlib.metadata, os, re, sys
venv, src = sys.argv[1], sys.argv[2]
import cuma
h = cuma.Heap("backend:sim,capacity:1G")
p = h.alloc(1 << 20)
h.free(p)
h.validate()
del h
pkg = os.path.dirname(os.path.abspath(cuma.__file__))
lib = cuma.library_path()
ver = importlib.metadata.version("cuma")
cmake_ver = re.search(r"project\(cuma\s+VERSION\s+([0-9.]+)", open(os.path.join(src, "CMakeLists.txt")).read()).group(1)
print("  package %s\n  library %s\n  version %s" % (pkg, lib, ver))
assert pkg.startswith(os.path.realpath(venv)) or pkg.startswith(venv), "cuma imported from " + pkg
assert os.path.dirname(lib) == pkg, "library not the bundled one: " + lib
assert ver == cmake_ver, "metadata version %s, CMakeLists.txt says %s" % (ver, cmake_ver)
PY
"$tmp/v/bin/pip" show cuma >"$tmp/show" && grep '^Version: ' "$tmp/show" >/dev/null || fail "pip show cuma"

step "python tests against the installed copy"
cp -r "$tmp/src/python/tests" "$tmp/elsewhere/tests"
"$tmp/v/bin/python" -m pytest -q -p no:cacheprovider tests/test_heap.py tests/test_snapshot.py ||
  fail "python tests against the installed package"
echo "pip-check: ok"
