// SPDX-License-Identifier: Apache-2.0
/* The placement policies, one line each: X(name, what it is). The settings accept these names
 * for `policy` (and bestfit, an alias of tlsf), and place/policy.c finds each one's operations
 * as cuma_<name>_ops. A new policy is its file in place/ and a line here. */
#ifndef CUMA_SETTINGS_POLICIES_H
#define CUMA_SETTINGS_POLICIES_H

#define CUMA_POLICY_LIST(X)                                                                        \
    X(tlsf, "good fit, O(1)")                                                                      \
    X(buddy, "power-of-two buddy system")

#endif
