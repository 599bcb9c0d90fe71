// SPDX-License-Identifier: Apache-2.0
/* The device backends, one line each: X(KIND, name, family, what). KIND names the
 * cuma_backend_kind (CUMA_BACKEND_<KIND>), `name` is the `backend` setting's value and the name
 * the stats show, `family` the constructor that makes it (cuma_<family>_backend_create, which
 * turns the setting into that kind), `what` the setting's help. The settings accept these names
 * and "auto" (the CUDA family picks vmm or segment), and backend/backend.c dispatches on them.
 * A new backend is its file in backend/ (with its constructor) and a line here. */
#ifndef CUMA_SETTINGS_BACKENDS_H
#define CUMA_SETTINGS_BACKENDS_H

#define CUMA_BACKEND_LIST(X)                                                                       \
    X(SIM, sim, sim, "simulated device")                                                           \
    X(VMM, vmm, cuda, "CUDA virtual memory")                                                       \
    X(SEGMENT, segment, cuda, "cuMemAlloc")                                                        \
    X(MANAGED, managed, cuda, "cuMemAllocManaged")

/* "sim|vmm|segment|managed|auto": the `backend` setting's choices. */
#define CUMA_BACKEND_NAME_BAR(kind, name, family, what) #name "|"
#define CUMA_BACKEND_CHOICES                            CUMA_BACKEND_LIST(CUMA_BACKEND_NAME_BAR) "auto"

#endif
