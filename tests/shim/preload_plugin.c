// SPDX-License-Identifier: Apache-2.0
/* Plugins for test_preload_loading, built twice (tests/shim/CMakeLists.txt):
 * - PLUGIN_SCOPE: looks driver entry points up through RTLD_DEFAULT from a library opened
 *   RTLD_LOCAL (as Python loads extension modules), whose own scope holds libcuda.
 * - PLUGIN_CTOR: its constructor allocates through the driver, as libraries that warm CUDA up at
 *   load time do, while the loader holds its lock. */
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#ifdef PLUGIN_SCOPE
void *plugin_lookup(const char *name) {
    return dlsym(RTLD_DEFAULT, name);
}
int plugin_init(void) { /* makes libcuda.so.1 a DT_NEEDED of the plugin */
    return (int)cuInit(0);
}
#endif

#ifdef PLUGIN_CTOR
static CUresult ctor_result = CUDA_ERROR_UNKNOWN;

__attribute__((constructor)) static void warm_up(void) {
    usleep(300 * 1000); /* the main thread makes its first driver call meanwhile */
    CUdevice d;
    CUcontext c;
    CUdeviceptr p;
    ctor_result = cuDeviceGet(&d, 0);
    if (ctor_result == CUDA_SUCCESS) ctor_result = cuDevicePrimaryCtxRetain(&c, d);
    if (ctor_result == CUDA_SUCCESS) ctor_result = cuCtxSetCurrent(c);
    if (ctor_result == CUDA_SUCCESS) ctor_result = cuMemAlloc_v2(&p, 4096);
    if (ctor_result == CUDA_SUCCESS) ctor_result = cuMemFree_v2(p);
}

int plugin_ctor_result(void) {
    return (int)ctor_result;
}
#endif
