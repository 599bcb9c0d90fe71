# SPDX-License-Identifier: Apache-2.0
"""One version everywhere: CMakeLists.txt's project() (which setup.py gives pip), the C header's
CUMA_VERSION_* macros (which the stats JSON reports) and cuma.__version__ are written in three
places; a release that bumps one must bump all."""
import os
import re

import cuma

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_versions_agree():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        project = re.search(r"project\(cuma VERSION (\d+\.\d+\.\d+)", f.read()).group(1)
    with open(os.path.join(ROOT, "include", "cuma", "cuma.h")) as f:
        h = f.read()
    header = ".".join(re.search(r"#define CUMA_VERSION_%s (\d+)" % k, h).group(1)
                      for k in ("MAJOR", "MINOR", "PATCH"))
    assert (project, header, cuma.__version__) == (project,) * 3
