#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Is there a usable NVIDIA GPU? Asks the CUDA driver itself (libcuda.so.1 through ctypes).

Prints one line and exits 0 when device 0 works:
    GPU: 1 device(s), driver API 13000, device 0 'NVIDIA H200' cc 9.0, 143 GiB, vmm 1
or exits 1 with the reason:
    NO GPU: libcuda.so.1 cannot be loaded (...)

Used by scripts/gpu-check.sh to decide whether the GPU steps run. It honours
CUMA_CUDA_LIBRARY like libcuma does (the script unsets it, so the real driver is asked).
"""

import ctypes
import os
import sys

# cuda.h's CUdevice_attribute values used here (stable since they were introduced).
ATTR_CC_MAJOR = 75
ATTR_CC_MINOR = 76
ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


def main():
    path = os.environ.get("CUMA_CUDA_LIBRARY") or "libcuda.so.1"
    try:
        cu = ctypes.CDLL(path)
    except OSError as e:
        print("NO GPU: %s cannot be loaded (%s)" % (path, e))
        return 1

    def name_of(rc):
        s = ctypes.c_char_p()
        try:
            if cu.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
                return "%s (%d)" % (s.value.decode(), rc)
        except AttributeError:
            pass
        return "CUresult %d" % rc

    rc = cu.cuInit(0)
    if rc != 0:
        print("NO GPU: cuInit(0) failed: %s" % name_of(rc))
        return 1
    ver = ctypes.c_int(0)
    cu.cuDriverGetVersion(ctypes.byref(ver))
    n = ctypes.c_int(0)
    rc = cu.cuDeviceGetCount(ctypes.byref(n))
    if rc != 0 or n.value < 1:
        print("NO GPU: cuDeviceGetCount: %s, %d device(s)" % (name_of(rc), n.value))
        return 1
    dev = ctypes.c_int(0)
    rc = cu.cuDeviceGet(ctypes.byref(dev), 0)
    if rc != 0:
        print("NO GPU: cuDeviceGet(0): %s" % name_of(rc))
        return 1
    name = ctypes.create_string_buffer(256)
    cu.cuDeviceGetName(name, 256, dev)
    total = ctypes.c_size_t(0)
    cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
    vals = {}
    for key, attr in (("major", ATTR_CC_MAJOR), ("minor", ATTR_CC_MINOR), ("vmm", ATTR_VMM)):
        v = ctypes.c_int(-1)
        cu.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
        vals[key] = v.value
    print(
        "GPU: %d device(s), driver API %d, device 0 '%s' cc %d.%d, %.0f GiB, vmm %d"
        % (n.value, ver.value, name.value.decode(errors="replace"), vals["major"], vals["minor"],
           total.value / 2**30, vals["vmm"])
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
