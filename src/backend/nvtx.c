// SPDX-License-Identifier: Apache-2.0
/* The marks of src/util/marks.h as NVTX v3 ranges in a "cuma" domain. NVTX v3 is header-only:
 * the first call looks for a tool (NVTX_INJECTION64_PATH, which nsys sets) and without one
 * every later call is an empty function. Names are registered strings, so that a push hands
 * the tool a handle, not text to hash. Built without the headers (CUMA_HAVE_NVTX unset), the
 * functions are stubs and nvtx:on is refused with cuma_marks_missing's reason. */
#include "util/marks.h"

#include <stddef.h>

#ifdef CUMA_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>

#include <pthread.h>
#include <stdint.h>

/* Colours by kind (ARGB): page calls blue, releases green, the ladder red, waits yellow, the
 * ledger purple: a timeline shows at a glance which kind of slow path takes the time. */
#define BLUE   0xFF3B7DD8u
#define GREEN  0xFF2E9E5Bu
#define RED    0xFFD0393Bu
#define YELLOW 0xFFE0B030u
#define PURPLE 0xFF8E5CC2u

static const struct {
    const char *name;
    uint32_t argb;
} mark_info[CUMA_MARK_N] = {
    [CUMA_MARK_PAGE_CREATE] = {"page create", BLUE},
    [CUMA_MARK_PAGE_MAP] = {"page map", BLUE},
    [CUMA_MARK_PAGE_UNMAP] = {"page unmap", BLUE},
    [CUMA_MARK_PAGE_RELEASE] = {"page release", BLUE},
    [CUMA_MARK_SEG_ALLOC] = {"segment alloc", BLUE},
    [CUMA_MARK_SEG_FREE] = {"segment free", BLUE},
    [CUMA_MARK_RELEASE] = {"release", GREEN},
    [CUMA_MARK_RELEASE_PASS] = {"release pass", GREEN},
    [CUMA_MARK_TRIM] = {"trim", GREEN},
    [CUMA_MARK_FENCE_WAIT] = {"fence wait", YELLOW},
    [CUMA_MARK_OOM] = {"oom", RED},
    [CUMA_MARK_OOM_CACHE] = {"oom cache", RED},
    [CUMA_MARK_OOM_ARENAS] = {"oom arenas", RED},
    [CUMA_MARK_OOM_LEDGER] = {"oom ledger", PURPLE},
    [CUMA_MARK_OOM_CALLBACKS] = {"oom callbacks", RED},
    [CUMA_MARK_OOM_MANAGED] = {"oom managed", RED},
    [CUMA_MARK_LEDGER_ANSWER] = {"ledger answer", PURPLE},
};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static nvtxDomainHandle_t domain;
static nvtxEventAttributes_t attrs[CUMA_MARK_N];

static void init_once(void) {
    domain = nvtxDomainCreateA("cuma");
    for (int i = 0; i < CUMA_MARK_N; i++) {
        nvtxEventAttributes_t a = {0};
        a.version = NVTX_VERSION;
        a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
        a.colorType = NVTX_COLOR_ARGB;
        a.color = mark_info[i].argb;
        a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
        a.message.registered = nvtxDomainRegisterStringA(domain, mark_info[i].name);
        attrs[i] = a;
    }
}

const char *cuma_marks_missing(void) {
    return NULL;
}

void cuma_marks_init(void) {
    pthread_once(&once, init_once);
}

void cuma_marks_push(enum cuma_mark m) {
    pthread_once(&once, init_once);
    nvtxDomainRangePushEx(domain, &attrs[m]);
}

void cuma_marks_pop(void) {
    nvtxDomainRangePop(domain);
}

#else

const char *cuma_marks_missing(void) {
    return "this libcuma was built without NVTX (no nvtx3/nvToolsExt.h under "
           "CUMA_CUDA_INCLUDE_DIR, "
           "or CUMA_NVTX=OFF): rebuild it where the CUDA toolkit's headers are, or use nvtx:off";
}

void cuma_marks_init(void) {}

void cuma_marks_push(enum cuma_mark m) {
    (void)m;
}

void cuma_marks_pop(void) {}

#endif
