// SPDX-License-Identifier: Apache-2.0
/* An NVTX injection library, as nsys is one: NVTX v3 in the program loads the library that
 * NVTX_INJECTION64_PATH names at its first call and hands InitializeInjectionNvtx2 its function
 * tables, whose entries a tool replaces. This one records what it receives to the file that
 * CUMA_NVTX_LOG names, one line each (written whole, so threads do not interleave):
 *
 *   init
 *   domain NAME
 *   push TID DEPTH DOMAIN NAME      DEPTH: ranges open on the thread before this one
 *   pop TID DEPTH DOMAIN            DEPTH: ranges open on the thread after this one
 *
 * A pop without an open range is written with DEPTH -1. Domains and registered strings are
 * handles to records of this library's own (their types are opaque to the program). */
#include <nvtx3/nvToolsExt.h>

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

struct nvtxDomainRegistration_st {
    char name[64];
};
struct nvtxStringRegistration_st {
    char text[128];
};

static int log_fd = -1;
static __thread int depth;
static struct nvtxDomainRegistration_st default_domain = {"(default)"};

static void put(const char *fmt, ...) {
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof line) n = sizeof line - 1;
    if (log_fd >= 0 && write(log_fd, line, (size_t)n) != n) abort();
}

static long tid(void) {
    return (long)syscall(SYS_gettid);
}

static const char *domain_name(nvtxDomainHandle_t d) {
    return (d ? d : &default_domain)->name;
}

static const char *message_of(const nvtxEventAttributes_t *a) {
    if (!a) return "(none)";
    switch (a->messageType) {
    case NVTX_MESSAGE_TYPE_ASCII:
        return a->message.ascii ? a->message.ascii : "(null)";
    case NVTX_MESSAGE_TYPE_REGISTERED:
        return a->message.registered ? a->message.registered->text : "(null)";
    default:
        return "(unsupported message type)";
    }
}

static nvtxDomainHandle_t NVTX_API domain_create(const char *name) {
    struct nvtxDomainRegistration_st *d = calloc(1, sizeof *d);
    if (!d) abort();
    snprintf(d->name, sizeof d->name, "%s", name ? name : "(null)");
    put("domain %s\n", d->name);
    return d;
}

static nvtxStringHandle_t NVTX_API register_string(nvtxDomainHandle_t d, const char *text) {
    (void)d;
    struct nvtxStringRegistration_st *s = calloc(1, sizeof *s);
    if (!s) abort();
    snprintf(s->text, sizeof s->text, "%s", text ? text : "(null)");
    return s;
}

static int push(const char *domain, const char *name) {
    put("push %ld %d %s %s\n", tid(), depth, domain, name);
    return depth++;
}

static int pop(const char *domain) {
    if (depth == 0) {
        put("pop %ld -1 %s\n", tid(), domain);
        return -1;
    }
    put("pop %ld %d %s\n", tid(), --depth, domain);
    return depth;
}

static int NVTX_API domain_push(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
    return push(domain_name(d), message_of(a));
}

static int NVTX_API domain_pop(nvtxDomainHandle_t d) {
    return pop(domain_name(d));
}

static int NVTX_API push_a(const char *message) {
    return push(default_domain.name, message ? message : "(null)");
}

static int NVTX_API pop_default(void) {
    return pop(default_domain.name);
}

/* Puts fn in slot id of a module's table (a table holds pointers to the program's function
 * pointers); false when the program's NVTX has no such slot. */
static int attach(const NvtxExportTableCallbacks *cb, NvtxCallbackModule module, unsigned id,
                  NvtxFunctionPointer fn) {
    NvtxFunctionTable table = NULL;
    unsigned size = 0;
    if (!cb->GetModuleFunctionTable(module, &table, &size) || !table || id >= size || !table[id])
        return 0;
    *table[id] = fn;
    return 1;
}

NVTX_DYNAMIC_EXPORT int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
    const char *path = getenv("CUMA_NVTX_LOG");
    if (!path) return 0;
    log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (log_fd < 0) return 0;
    const NvtxExportTableCallbacks *cb = get_table(NVTX_ETID_CALLBACKS);
    if (!cb || cb->struct_size < sizeof *cb) return 0;
    int ok =
        attach(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainCreateA,
               (NvtxFunctionPointer)domain_create) &&
        attach(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRegisterStringA,
               (NvtxFunctionPointer)register_string) &&
        attach(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePushEx,
               (NvtxFunctionPointer)domain_push) &&
        attach(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePop,
               (NvtxFunctionPointer)domain_pop) &&
        attach(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushA, (NvtxFunctionPointer)push_a) &&
        attach(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePop, (NvtxFunctionPointer)pop_default);
    if (ok) put("init\n");
    return ok;
}
