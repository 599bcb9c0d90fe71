// SPDX-License-Identifier: Apache-2.0
/* The backends by kind (src/settings/backends.h, src/backend/backend.c): every line of
 * CUMA_BACKEND_LIST is a name the settings accept, which finds its kind and back; the simulated
 * device made from its name has its kind and name; "auto" and unknown names are no kind, and a
 * settings struct with an unknown name (made by hand, past the parser) is refused by name. */
#include "backend/backend.h"
#include "check.h"
#include "settings/backends.h"
#include "settings/config.h"
#include "util/error.h"

#include <stdio.h>
#include <string.h>

static void check_kind(cuma_backend_kind kind, const char *name) {
    cuma_backend_kind found = (cuma_backend_kind)-1;
    CHECK(cuma_backend_kind_find(name, &found) && found == kind);
    CHECK(!strcmp(cuma_backend_kind_name(kind), name));
    char conf[64];
    snprintf(conf, sizeof conf, "backend:%s", name);
    cuma_settings s;
    cuma_settings_default(&s);
    CHECK_OK(cuma_settings_parse(&s, conf, "test"));
    CHECK(!strcmp(s.backend, name));
    if (kind != CUMA_BACKEND_SIM) return; /* the CUDA kinds: tests/cuda/test_cuda_backend.c */
    cuma_backend *be = NULL;
    CHECK_OK(cuma_backend_create(&s, &be));
    CHECK(be->kind == kind && !strcmp(be->name, name));
    be->ops->destroy(be);
}

int main(void) {
    int n = 0;
#define CHECK_LINE(kind, name, family, what) check_kind(CUMA_BACKEND_##kind, #name), n++;
    CUMA_BACKEND_LIST(CHECK_LINE)
#undef CHECK_LINE
    CHECK(n == 4);
    cuma_backend_kind k;
    CHECK(!cuma_backend_kind_find("auto", &k) && !cuma_backend_kind_find("bogus", &k));
    CHECK(!strcmp(cuma_backend_kind_name((cuma_backend_kind)n), "?"));

    cuma_settings s;
    cuma_settings_default(&s);
    CHECK(cuma_settings_parse(&s, "backend:bogus", "test") == CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "bogus") && strstr(cuma_last_error(), "sim|vmm"));
    snprintf(s.backend, sizeof s.backend, "bogus");
    cuma_backend *be = NULL;
    CHECK(cuma_backend_create(&s, &be) == CUMA_ERR_CONFIG && !be);
    CHECK(strstr(cuma_last_error(), "'bogus'"));
    printf("test_backend_kinds: all passed\n");
    return 0;
}
