# SPDX-License-Identifier: Apache-2.0
"""Checks the Dockerfile where no container builder runs (scripts/docker-check.sh).

1. Lint: stages and COPY --from names, pinned base image (no :latest), apt-get install with
   --no-install-recommends and the lists removed in the same RUN, a numeric non-root USER in
   the last stage, an exec-form ENTRYPOINT, every COPY source present in the context and not
   hidden by .dockerignore.
2. The build stage on this host: its COPY lines are carried out into a scratch /src, its RUN of
   scripts/image-build.sh is run with /src and /stage moved into the scratch folder (the host is
   Debian 12 with the stage's packages, the base image's release), then the last stage's
   COPY --from=build is checked: the staged cuma command runs, the staged Python package imports
   and loads the staged library. This runs the stage's commands, not a container: the apt-get
   steps and the image itself are not exercised.

usage: python3 scripts/docker_check.py REPO SCRATCH
"""

import fnmatch
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

repo, scratch = sys.argv[1], sys.argv[2]
errors = []


def err(msg):
    errors.append(msg)
    print("  FAIL " + msg)


def instructions(path):
    out, cur, lineno = [], "", 0
    for n, raw in enumerate(open(path), 1):
        line = raw.rstrip("\n")
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not cur:
            lineno = n
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((lineno, word.upper(), rest.strip()))
        cur = ""
    return out


ins = instructions(os.path.join(repo, "Dockerfile"))
args = {}
stages = []  # [name, [instructions]]
for lineno, word, rest in ins:
    if word == "ARG" and not stages:
        k, _, v = rest.partition("=")
        args[k] = v
    elif word == "FROM":
        parts = rest.split()
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), parts[0])
        if ":" not in image or image.endswith(":latest"):
            err("line %d: base image %r is not pinned to a release tag" % (lineno, image))
        name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
        stages.append([name, []])
    else:
        stages[-1][1].append((lineno, word, rest))

print("== docker-check: lint (%d stages)" % len(stages))
if len(stages) < 2:
    err("not a multi-stage build")
ignore = [l.strip() for l in open(os.path.join(repo, ".dockerignore")) if l.strip() and not l.startswith("#")]


def ignored(rel):
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel.split("/")[0], p) for p in ignore)


names = [s[0] for s in stages]
for i, (name, body) in enumerate(stages):
    for lineno, word, rest in body:
        if word == "RUN" and "apt-get install" in rest:
            if "--no-install-recommends" not in rest:
                err("line %d: apt-get install without --no-install-recommends" % lineno)
            if "rm -rf /var/lib/apt/lists" not in rest:
                err("line %d: apt lists left in the layer" % lineno)
        if word == "COPY":
            toks = shlex.split(rest)
            frm = [t for t in toks if t.startswith("--from=")]
            toks = [t for t in toks if not t.startswith("--")]
            if frm:
                if frm[0][7:] not in names[:i]:
                    err("line %d: COPY --from=%s names no earlier stage" % (lineno, frm[0][7:]))
                continue
            matched = 0
            for src in toks[:-1]:
                hits = [h for h in glob.glob(os.path.join(repo, src)) if not ignored(os.path.relpath(h, repo))]
                matched += len(hits)
                if not hits and not any(c in src for c in "*?["):
                    err("line %d: COPY source %s not in the build context" % (lineno, src))
            if not matched:
                err("line %d: COPY copies nothing" % lineno)
last = stages[-1][1]
users = [rest for _, w, rest in last if w == "USER"]
if not users or not re.match(r"^[1-9][0-9]*(:[0-9]+)?$", users[-1]):
    err("last stage: USER must be a numeric non-root uid (got %r)" % (users[-1] if users else None))
ep = [rest for _, w, rest in last if w == "ENTRYPOINT"]
if not ep or not ep[-1].startswith("["):
    err("last stage: ENTRYPOINT missing or not in exec form")
if not errors:
    print("  ok")

print("== docker-check: the build stage's commands on this host")
build = [s for s in stages if s[0] == "build"][0][1]
src = os.path.join(scratch, "src")
stage = os.path.join(scratch, "stage")
os.makedirs(src)
workdir = "/"
for lineno, word, rest in build:
    if word == "WORKDIR":
        workdir = rest
    elif word == "COPY":
        toks = shlex.split(rest)
        dst = toks[-1]
        dst = dst if dst.startswith("/") else os.path.join(workdir, dst)
        dst = os.path.join(scratch, dst.lstrip("/").replace("src", "src", 1))
        for s in toks[:-1]:
            for hit in glob.glob(os.path.join(repo, s)):
                if ignored(os.path.relpath(hit, repo)):
                    continue
                if os.path.isdir(hit):
                    # Docker copies a directory's contents into the destination
                    shutil.copytree(hit, dst if not dst.endswith("/") else dst, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    d = dst if (dst.endswith("/") or len(toks) > 2) else os.path.dirname(dst)
                    os.makedirs(d, exist_ok=True)
                    shutil.copy2(hit, d if (dst.endswith("/") or len(toks) > 2 or dst.endswith("./")) else dst)
    elif word == "RUN" and "image-build.sh" in rest:
        cmd = rest.replace("/stage", stage).replace("/src", src)
        print("  $ " + cmd)
        env = dict(os.environ, IMAGE_BUILD_DIR=os.path.join(scratch, "build"))
        if subprocess.call(cmd, shell=True, cwd=src, env=env) != 0:
            err("line %d: the build stage's RUN failed" % lineno)
copies = [shlex.split(r) for _, w, r in last if w == "COPY" and "--from=build" in r]
for toks in copies:
    staged = os.path.join(scratch, toks[-2].lstrip("/"))
    if not os.path.isdir(staged):
        err("COPY --from=build %s: not made by the build stage" % toks[-2])
prefix = os.path.join(stage, "usr/local")
exe = os.path.join(prefix, "bin/cuma")
libdir = os.path.join(prefix, "lib")
env = dict(os.environ, LD_LIBRARY_PATH=libdir)
env.pop("CUMA_LIBRARY", None)
for f in ("bin/cuma", "lib/libcuma.so.0", "include/cuma/cuma.h"):
    if not os.path.exists(os.path.join(prefix, f)):
        err("the image would lack /usr/local/" + f)
try:
    print("  $ cuma version -> " + subprocess.check_output([exe, "version"], env=env, universal_newlines=True).strip())
except (OSError, subprocess.CalledProcessError) as e:
    err("staged cuma version: %s" % e)
pys = glob.glob(os.path.join(prefix, "lib/python3*/dist-packages"))
if not pys:
    err("the image would lack the Python package")
else:
    env["PYTHONPATH"] = pys[0]
    code = ("import cuma; h = cuma.Heap('backend:sim,capacity:1G'); p = h.alloc(1 << 20); h.free(p); "
            "print(cuma.library_path())")
    try:
        out = subprocess.check_output(["/usr/bin/python3", "-c", code], env=env, cwd=scratch,
                                      universal_newlines=True).strip()
        print("  $ python3 -c 'import cuma; ...' -> " + out)
        if not out.startswith(stage):
            err("the staged package loaded %s, not the staged library" % out)
    except subprocess.CalledProcessError as e:
        err("staged python package: %s" % e)
sys.exit(1 if errors else 0)
