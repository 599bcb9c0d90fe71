// SPDX-License-Identifier: Apache-2.0
/* Opening the files a heap writes because a setting names them (`trace:FILE`, `oom_dump:FILE`).
 * The names come from a shared environment variable and often point into /tmp, where another
 * user may have planted something at the name first. What is guaranteed for the last component
 * of the name: a symbolic link is never followed, nothing but a regular file is ever opened (a
 * FIFO or a device is refused before it is opened, so nothing blocks on it), a file owned by
 * another user or with other names (hard links) is refused, and a file created here has mode
 * 0600. The directories on the way are trusted as they are: a symlink among them is followed,
 * so the file should sit in a directory only its user can change or in a sticky one (/tmp).
 *
 * Every call returns -1 with a reason in why (a short text for "FILE: ..." messages) and errno
 * set, or a descriptor with FD_CLOEXEC, blocking. */
#ifndef CUMA_UTIL_SAFEFILE_H
#define CUMA_UTIL_SAFEFILE_H

#include <stddef.h>
#include <sys/types.h>

/* Opens path to write (creating it with mode 0600 when absent; an existing file of the user's
 * keeps its mode and contents: the caller truncates it once it holds it). */
int cuma_file_open_log(const char *path, char *why, size_t wlen);

/* Creates a new temporary file beside target, for writing whole and renaming onto target: an
 * unguessable name (target.tmp-RANDOM, into tmp, tlen bytes), created exclusively. Refuses
 * when target itself is not absent or a regular file of the user's (the rename would replace
 * a link, a device or someone else's file). The temporary's mode is target's when it exists,
 * else 0600. */
int cuma_file_create_temp(const char *target, char *tmp, size_t tlen, char *why, size_t wlen);

#endif
