# SPDX-License-Identifier: Apache-2.0
"""The `cuma` console entry point of a pip-installed package: runs the native `cuma` command
bundled in the package (cuma/bin/cuma), with the same arguments, in place of this process."""

import os
import sys


def main():
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "cuma")
    if not os.access(exe, os.X_OK):
        sys.stderr.write(
            "cuma: the native command %s is missing (this copy of the package was not built by "
            "`pip install`); build it with CMake (tools/) or reinstall the package\n" % exe
        )
        return 127
    os.execv(exe, [exe] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
