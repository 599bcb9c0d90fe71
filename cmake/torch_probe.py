# SPDX-License-Identifier: Apache-2.0
"""Says whether libcuma_torch_c10 can be built against the PyTorch this interpreter imports,
for src/shim/torch/CMakeLists.txt. Prints four lines: torch.__version__, 1 or 0 for
_GLIBCXX_USE_CXX11_ABI, the include directory, and libc10.so.
Exits 1 with the reason on stderr when something is missing.

The directories are PyTorch's own (torch/include, torch/lib beside torch/__init__.py):
torch.utils.cpp_extension names the same ones but imports setuptools and probes for CUDA,
which costs seconds at every configure. Debian's python3-torch has torch/include as links
into /usr/include that dangle until libtorch-dev is installed, so the header is looked for."""
import os
import sys

try:
    import torch
except Exception as e:  # ImportError, or a broken install raising anything else
    sys.exit("PyTorch cannot be imported (%s: %s)" % (type(e).__name__, e))
root = os.path.dirname(torch.__file__)
inc = os.path.join(root, "include")
lib = os.path.join(root, "lib")
if not os.path.isfile(os.path.join(inc, "c10", "util", "Exception.h")):
    sys.exit("PyTorch %s has no C++ headers: %s/c10/util/Exception.h is missing (Debian: "
             "install libtorch-dev)" % (torch.__version__, inc))
c10 = os.path.join(lib, "libc10.so")
if not os.path.isfile(c10):
    sys.exit("PyTorch %s has no %s" % (torch.__version__, c10))
abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)
print(torch.__version__)
print(1 if abi else 0)
print(os.path.realpath(inc))
print(c10)
