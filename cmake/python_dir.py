# SPDX-License-Identifier: Apache-2.0
"""Prints where the interpreter running it looks for pure-Python packages under an install
prefix, relative to that prefix (for CMakeLists.txt's install of the cuma package)."""
import os
import sys
import sysconfig

scheme = sysconfig.get_default_scheme() if hasattr(sysconfig, "get_default_scheme") else ""
if scheme == "posix_local":
    # Debian's interpreter: packages installed under /usr/local go to dist-packages there.
    print("lib/python%d.%d/dist-packages" % sys.version_info[:2])
else:
    base = "/prefix"
    path = sysconfig.get_path("purelib", "posix_prefix", vars={"base": base, "platbase": base})
    print(os.path.relpath(path, base))
