// SPDX-License-Identifier: Apache-2.0
/* Runs a fuzz harness over saved inputs without libFuzzer: every file named on the command line,
 * and every file of every directory named there (in name order, so runs repeat exactly). Any
 * compiler builds it, so ctest replays the seed corpora and the saved crash reproducers on every
 * build; an input that breaks an invariant aborts the run. */
#include "fuzz.h"

#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

/* An exact-size copy: a harness reading past the input's end is then caught by AddressSanitizer
 * here as it would be under libFuzzer. */
static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    if (fstat(fileno(f), &sb) || sb.st_size < 0) {
        fprintf(stderr, "%s: cannot stat\n", path);
        fclose(f);
        return -1;
    }
    size_t n = (size_t)sb.st_size;
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf || fread(buf, 1, n, f) != n) {
        fprintf(stderr, "%s: cannot read %zu bytes\n", path, n);
        free(buf);
        fclose(f);
        return -1;
    }
    fclose(f);
    fprintf(stderr, "input %s (%zu bytes)\n", path, n);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 1;
}

static int visible(const struct dirent *e) {
    return e->d_name[0] != '.';
}

static int run_dir(const char *dir) {
    struct dirent **names;
    int k = scandir(dir, &names, visible, alphasort);
    if (k < 0) {
        fprintf(stderr, "%s: %s\n", dir, strerror(errno));
        return -1;
    }
    int ran = 0, bad = 0;
    for (int i = 0; i < k; i++) {
        char path[4096];
        struct stat sb;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]->d_name);
        if (!stat(path, &sb) && S_ISREG(sb.st_mode)) {
            if (run_file(path) < 0)
                bad = 1;
            else
                ran++;
        }
        free(names[i]);
    }
    free(names);
    return bad ? -1 : ran;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE|DIR...\n", argv[0]);
        return 2;
    }
    int total = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        int r = !stat(argv[i], &sb) && S_ISDIR(sb.st_mode) ? run_dir(argv[i]) : run_file(argv[i]);
        if (r < 0) return 1;
        total += r;
    }
    /* An empty or misnamed corpus would otherwise pass while testing nothing. */
    if (!total) {
        fprintf(stderr, "no inputs found\n");
        return 1;
    }
    fprintf(stderr, "%d inputs ran, no invariant broken\n", total);
    return 0;
}
