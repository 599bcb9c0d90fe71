// SPDX-License-Identifier: Apache-2.0
/* The policies by name: settings/policies.h lists them. */
#include "place/policy.h"
#include "settings/policies.h"

#include <string.h>

#define CUMA_POLICY_OPS(name, what) &cuma_##name##_ops,
static const cuma_policy_ops *const policies[] = {CUMA_POLICY_LIST(CUMA_POLICY_OPS)};
#undef CUMA_POLICY_OPS

const cuma_policy_ops *cuma_policy_find(const char *name) {
    for (size_t i = 0; i < sizeof policies / sizeof policies[0]; i++)
        if (!strcmp(policies[i]->name, name)) return policies[i];
    return NULL;
}
