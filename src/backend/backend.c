/* Picks the backend a heap's settings name. */
#include "backend.h"
#include "core/error.h"

#include <string.h>

cuma_status cuma_backend_create(const cuma_settings *s, cuma_backend **out) {
    if (!strcmp(s->backend, "sim")) return cuma_sim_backend_create(s, out);
#ifdef CUMA_HAVE_CUDA
    return cuma_cuda_backend_create(s, out);
#else
    return cuma_fail(CUMA_ERR_NO_DEVICE,
                     "backend '%s': this libcuma was built without the CUDA backends (no cuda.h)",
                     s->backend);
#endif
}
