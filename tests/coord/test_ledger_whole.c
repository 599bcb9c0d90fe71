// SPDX-License-Identifier: Apache-2.0
/* A ledger appears whole: while a heap makes a ledger, its name never leads to a file without
 * the header (readers took such a file for one that is no ledger: test_ledger_stress's sampler
 * failed so under ThreadSanitizer). This test's ftruncate stands in for libc's: at the moment
 * the maker sizes the file, it looks at what the ledger's name leads to. A user's ledger and
 * one of the process's own group. */
#include "check.h"
#include "coord/ledger_shm.h"
#include "cuma/ledger.h"

#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static char watched[160]; /* the ledger's path while a heap makes it; "" otherwise */
static char made_at[192]; /* the file the maker sized (to see it gone afterwards) */
static int sized;         /* times the maker sized a file while watched */

int ftruncate(int fd, off_t len) {
    int r = (int)syscall(SYS_ftruncate, fd, len);
    if (!watched[0]) return r;
    sized++;
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, made_at, sizeof made_at - 1);
    made_at[n > 0 ? n : 0] = 0;
    int lf = open(watched, O_RDONLY | O_CLOEXEC);
    if (lf >= 0) {
        uint64_t magic = 0;
        ssize_t got = pread(lf, &magic, sizeof magic, 0);
        close(lf);
        if (got != (ssize_t)sizeof magic || magic != LEDGER_MAGIC) {
            fprintf(stderr, "%s is there without its header (%zd bytes read) while it is made\n",
                    watched, got);
            CHECK(!"a ledger's name led to a header-less file");
        }
    }
    return r;
}

static void make_one(const char *name) {
    char path[160], conf[256];
    CHECK_OK(cuma_ledger_path(name, path, sizeof path));
    unlink(path);
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,ledger:%s", name);
    snprintf(watched, sizeof watched, "%s", path);
    sized = 0;
    cuma_heap *h = heap_make(conf);
    watched[0] = 0;
    CHECK(sized == 1); /* the file was made (and looked at) once */
    struct stat sb;
    CHECK(stat(made_at, &sb) != 0 || !strcmp(made_at, path)); /* no file left behind */
    size_t n = 0;
    cuma_ledger_entry e[4];
    CHECK_OK(cuma_ledger_snapshot(name, e, 4, &n));
    CHECK(n == 1 && e[0].pid == getpid());
    cuma_heap_destroy(h);
    CHECK(unlink(path) == 0);
    fprintf(stderr, "%s: made whole (sized as %s)\n", path, made_at);
}

int main(void) {
    char name[96];
    snprintf(name, sizeof name, "whole-%d", (int)getpid());
    make_one(name);
    struct group *g = getgrgid(getegid());
    if (g && strlen(g->gr_name) <= 48) {
        snprintf(name, sizeof name, "@%s+whole-%d", g->gr_name, (int)getpid());
        make_one(name);
    }
    puts("test_ledger_whole: ok");
    return 0;
}
