// SPDX-License-Identifier: Apache-2.0
/* LOG.stacks read back. Named frames (F records) are taken as written; a return address is the
 * instruction after a call: the address one before it is looked up, inside the call. The module's
 * file offset of that address is turned into the address the ELF file links it at (its PT_LOAD
 * headers), which is what addr2line wants, for executables and shared libraries alike. */
#include "stack_file.h"

#include "util/error.h"
#include "stacks.h"

#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define MAX_STACK_FRAMES 64

typedef struct module {
    uint64_t start, end, off;
    char *path;
} module;

/* A distinct address, or a named frame (named: its index + 1 in reader.named). */
typedef struct addr_frame {
    uint64_t addr;
    uint32_t frame; /* frame id once symbolised */
    uint32_t named;
} addr_frame;

/* A named frame (F record): its file and name in one allocation, file first. */
typedef struct named_frame {
    char *file;
    const char *name;
    uint32_t line;
    uint32_t addr; /* its entry in reader.addrs */
} named_frame;

typedef struct reader {
    const char *path;
    size_t line;
    module *mods;
    size_t nmods, mods_cap;
    addr_frame *addrs; /* distinct addresses, in order of first use */
    size_t naddrs, addrs_cap;
    uint32_t *stack_addrs; /* per stack: indexes into addrs */
    size_t *stack_start;   /* per stack id (from 1): start in stack_addrs; [0] unused */
    size_t nstack_addrs, stack_addrs_cap, nstacks, stacks_cap;
    named_frame *named; /* per F id - 1 */
    size_t nnamed, named_cap;
    int version;
} reader;

static cuma_status bad(const reader *r, const char *what) {
    return cuma_fail(CUMA_ERR_PARSE, "%s:%zu: %s", r->path, r->line, what);
}

static int grow(void **p, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * size);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* The index of addr among the distinct addresses (added if new); linear in the worst case, but
 * stacks repeat and the file holds each distinct stack once. */
static long addr_index(reader *r, uint64_t a) {
    for (size_t i = r->naddrs; i-- > 0;)
        if (r->addrs[i].addr == a && !r->addrs[i].named) return (long)i;
    if (grow((void **)&r->addrs, &r->addrs_cap, r->naddrs + 1, sizeof *r->addrs)) return -1;
    r->addrs[r->naddrs] = (addr_frame){a, 0, 0};
    return (long)r->naddrs++;
}

static cuma_status oom(const reader *r) {
    return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", r->path);
}

/* "F ID LINE FILE<TAB>NAME": a named frame. */
static cuma_status parse_named(reader *r, char *p) {
    char *end;
    unsigned long long id = strtoull(p, &end, 10);
    if (id != r->nnamed + 1) return bad(r, "named frame ids must count up from 1");
    if (*end != ' ') return bad(r, "bad named frame record");
    unsigned long long line = strtoull(end + 1, &end, 10);
    char *tab = *end == ' ' ? strchr(end + 1, '\t') : NULL;
    if (!tab || line > UINT32_MAX) return bad(r, "bad named frame record");
    named_frame f = {.line = (uint32_t)line, .addr = (uint32_t)r->naddrs};
    *tab = 0;
    size_t flen = strlen(end + 1);
    if (grow((void **)&r->named, &r->named_cap, r->nnamed + 1, sizeof *r->named) ||
        grow((void **)&r->addrs, &r->addrs_cap, r->naddrs + 1, sizeof *r->addrs) ||
        !(f.file = malloc(flen + 1 + strlen(tab + 1) + 1)))
        return oom(r);
    memcpy(f.file, end + 1, flen + 1);
    f.name = strcpy(f.file + flen + 1, tab + 1);
    r->named[r->nnamed++] = f;
    r->addrs[r->naddrs++] = (addr_frame){0, 0, (uint32_t)r->nnamed};
    return CUMA_OK;
}

/* "S ID ADDR..." (named 0) or "P ID FRAME..." (named 1): a stack, from its id on. */
static cuma_status parse_stack(reader *r, char *p, int named) {
    char *end;
    unsigned long long id = strtoull(p, &end, 10);
    if (id != r->nstacks + 1) return bad(r, "stack ids must count up from 1");
    if (grow((void **)&r->stack_start, &r->stacks_cap, id + 2, sizeof *r->stack_start))
        return oom(r);
    r->stack_start[id] = r->nstack_addrs;
    int n = 0;
    for (;;) {
        while (*end == ' ') end++;
        if (!*end) break;
        char *e2;
        uint64_t a = strtoull(end, &e2, named ? 10 : 16);
        if (e2 == end || (*e2 && *e2 != ' '))
            return bad(r, named ? "bad frame id in a stack" : "bad address in a stack");
        if (named && (!a || a > r->nnamed)) return bad(r, "a stack names a frame not given");
        end = e2;
        if (++n > MAX_STACK_FRAMES) return bad(r, "too many frames in a stack");
        long ix = named ? (long)r->named[a - 1].addr : addr_index(r, a);
        if (ix < 0 || grow((void **)&r->stack_addrs, &r->stack_addrs_cap, r->nstack_addrs + 1,
                           sizeof *r->stack_addrs))
            return oom(r);
        r->stack_addrs[r->nstack_addrs++] = (uint32_t)ix;
    }
    r->nstacks = id;
    r->stack_start[id + 1] = r->nstack_addrs;
    return CUMA_OK;
}

static cuma_status parse_line(reader *r, char *p, cuma_trace *t) {
    char *end;
    if (p[0] == 'M' && p[1] == ' ') {
        module m;
        m.start = strtoull(p + 2, &end, 16);
        m.end = strtoull(end, &end, 16);
        m.off = strtoull(end, &end, 16);
        while (*end == ' ') end++;
        if (*end != '/' || m.end <= m.start) return bad(r, "bad mapping record");
        if (grow((void **)&r->mods, &r->mods_cap, r->nmods + 1, sizeof *r->mods) ||
            !(m.path = strdup(end)))
            return oom(r);
        r->mods[r->nmods++] = m;
        return CUMA_OK;
    }
    if (p[0] == 'S' && p[1] == ' ') return parse_stack(r, p + 2, 0);
    if (r->version >= 2 && p[0] == 'P' && p[1] == ' ') return parse_stack(r, p + 2, 1);
    if (r->version >= 2 && p[0] == 'F' && p[1] == ' ') return parse_named(r, p + 2);
    if (p[0] == 'E' && p[1] == ' ') {
        unsigned long long ev = strtoull(p + 2, &end, 10);
        unsigned long long id = strtoull(end, &end, 10);
        while (*end == ' ') end++;
        if (*end || !id || id > r->nstacks) return bad(r, "bad event record");
        if (ev >= t->n) return bad(r, "an event past the log's end (another log's stacks?)");
        t->stack[ev] = (uint32_t)id; /* the file's stack id: renumbered once symbolised */
        return CUMA_OK;
    }
    return bad(r, r->version >= 2 ? "unknown record (M, S, F, P or E expected)"
                                  : "unknown record (M, S or E expected)");
}

/* The address the ELF file at path links file offset off at; 0 when it cannot tell. */
static uint64_t link_address(const char *path, uint64_t off) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    Elf64_Ehdr eh;
    uint64_t out = 0;
    if (pread(fd, &eh, sizeof eh, 0) == (ssize_t)sizeof eh &&
        !memcmp(eh.e_ident, ELFMAG, SELFMAG) && eh.e_ident[EI_CLASS] == ELFCLASS64 &&
        eh.e_phentsize == sizeof(Elf64_Phdr) && eh.e_phnum < 256) {
        for (unsigned i = 0; i < eh.e_phnum; i++) {
            Elf64_Phdr ph;
            if (pread(fd, &ph, sizeof ph, (off_t)(eh.e_phoff + i * sizeof ph)) !=
                (ssize_t)sizeof ph)
                break;
            if (ph.p_type == PT_LOAD && off >= ph.p_offset && off < ph.p_offset + ph.p_filesz) {
                out = off - ph.p_offset + ph.p_vaddr;
                break;
            }
        }
    }
    close(fd);
    return out;
}

/* Runs addr2line -f -C -e path on n link addresses; its output (two lines an address) in a
 * malloc'd buffer, or NULL (no addr2line, or it failed). */
static char *run_addr2line(const char *path, const uint64_t *la, size_t n) {
    char **argv = calloc(n + 6, sizeof *argv);
    char *hex = malloc(n * 20);
    int pipefd[2] = {-1, -1};
    char *out = NULL;
    if (!argv || !hex || pipe(pipefd)) goto done;
    size_t k = 0;
    argv[k++] = "addr2line", argv[k++] = "-f", argv[k++] = "-C", argv[k++] = "-e";
    argv[k++] = (char *)path;
    for (size_t i = 0; i < n; i++) {
        snprintf(hex + i * 20, 20, "0x%" PRIx64, la[i]);
        argv[k++] = hex + i * 20;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addclose(&fa, pipefd[0]);
    pid_t pid;
    int err = posix_spawnp(&pid, "addr2line", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(pipefd[1]);
    pipefd[1] = -1;
    if (err) goto done;
    size_t len = 0, cap = 4096;
    out = malloc(cap);
    for (;;) {
        if (!out) break;
        if (len + 1 >= cap) {
            char *o = realloc(out, cap *= 2);
            if (!o) {
                free(out), out = NULL;
                break;
            }
            out = o;
        }
        ssize_t r = read(pipefd[0], out + len, cap - len - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        len += (size_t)r;
    }
    int wst;
    while (waitpid(pid, &wst, 0) < 0 && errno == EINTR) {
    }
    if (out) out[len] = 0;
    if (out && !(WIFEXITED(wst) && !WEXITSTATUS(wst))) free(out), out = NULL;
done:
    if (pipefd[0] >= 0) close(pipefd[0]);
    if (pipefd[1] >= 0) close(pipefd[1]);
    free(argv);
    free(hex);
    return out;
}

static const module *module_of(const reader *r, uint64_t a) {
    for (size_t i = r->nmods; i-- > 0;)
        if (a >= r->mods[i].start && a < r->mods[i].end) return &r->mods[i];
    return NULL;
}

/* Gives every distinct address its frame: per module, one addr2line run per 256 addresses. */
static cuma_status symbolise(reader *r, cuma_stacks_builder *b) {
    uint64_t la[256];
    size_t ix[256];
    char *done = calloc(r->naddrs + 1, 1);
    if (!done) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", r->path);
    cuma_status st = CUMA_OK;
    for (size_t i = 0; i < r->nnamed && !st; i++) {
        const named_frame *f = &r->named[i];
        done[f->addr] = 1;
        st = cuma_stacks_frame(b, f->file, strlen(f->file), f->name, strlen(f->name), f->line,
                               &r->addrs[f->addr].frame);
    }
    for (size_t i = 0; i < r->naddrs && !st; i++) {
        if (done[i]) continue;
        const module *m = module_of(r, r->addrs[i].addr);
        size_t n = 0;
        for (size_t j = i; j < r->naddrs && n < 256; j++) {
            if (done[j] || module_of(r, r->addrs[j].addr) != m) continue;
            uint64_t a = r->addrs[j].addr ? r->addrs[j].addr - 1 : 0;
            la[n] = m ? link_address(m->path, a - m->start + m->off) : 0;
            ix[n++] = j;
            done[j] = 1;
        }
        char *text = m ? run_addr2line(m->path, la, n) : NULL;
        char *p = text;
        for (size_t k = 0; k < n && !st; k++) {
            char name[512] = "", file[1024] = "";
            uint32_t line = 0;
            if (p) {
                char *nl = strchr(p, '\n');
                char *nl2 = nl ? strchr(nl + 1, '\n') : NULL;
                if (nl2) {
                    snprintf(name, sizeof name, "%.*s", (int)(nl - p), p);
                    char *loc = nl + 1;
                    char *colon = memrchr(loc, ':', (size_t)(nl2 - loc));
                    if (colon) {
                        snprintf(file, sizeof file, "%.*s", (int)(colon - loc), loc);
                        line = (uint32_t)strtoul(colon + 1, NULL, 10);
                    }
                    p = nl2 + 1;
                } else {
                    p = NULL;
                }
            }
            if (!strcmp(name, "??")) name[0] = 0;
            if (!strcmp(file, "??")) file[0] = 0;
            if (!name[0]) /* no symbol: the module and the address in it */
                snprintf(name, sizeof name, "%s+0x%" PRIx64, m ? (strrchr(m->path, '/') + 1) : "?",
                         la[k]);
            st = cuma_stacks_frame(b, file, strlen(file), name, strlen(name), line,
                                   &r->addrs[ix[k]].frame);
        }
        free(text);
    }
    free(done);
    return st;
}

cuma_status cuma_stack_file_read(const char *log_path, cuma_trace *t) {
    size_t plen = strlen(log_path) + sizeof ".stacks";
    char *path = malloc(plen);
    if (!path) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", log_path);
    snprintf(path, plen, "%s.stacks", log_path);
    FILE *f = fopen(path, "re");
    if (!f) {
        free(path);
        return CUMA_OK;
    }
    reader r = {.path = path};
    cuma_status st = CUMA_OK;
    if (!(t->stack = calloc(t->n ? t->n : 1, sizeof *t->stack)))
        st = cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    char line[4096 + 64 * 20];
    while (!st && fgets(line, sizeof line, f)) {
        r.line++;
        size_t len = strlen(line);
        if (len && line[len - 1] == '\n') line[--len] = 0;
        if (len == sizeof line - 1 && !feof(f)) {
            st = bad(&r, "line too long");
            break;
        }
        if (r.line == 1) {
            if (!strcmp(line, "cuma-stacks 1") || !strcmp(line, "cuma-stacks 2"))
                r.version = line[12] - '0';
            else if (!strncmp(line, "cuma-stacks ", 12))
                st = bad(&r, "a cuma stacks file of a later version than this cuma reads (1 and "
                             "2): read it with the cuma that wrote it");
            else
                st = bad(&r, "not a cuma stacks file");
            continue;
        }
        if (len) st = parse_line(&r, line, t);
    }
    fclose(f);
    cuma_stacks_builder b;
    int have_b = 0;
    if (!st && !(st = cuma_stacks_init(&b, path))) have_b = 1;
    if (!st) st = symbolise(&r, &b);
    /* The file's stacks in the table's numbering (0 stays "none"). */
    uint32_t *renum = NULL;
    if (!st && !(renum = calloc(r.nstacks + 1, sizeof *renum)))
        st = cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    for (size_t s = 1; !st && s <= r.nstacks; s++) {
        uint32_t fr[MAX_STACK_FRAMES];
        size_t n = 0;
        for (size_t k = r.stack_start[s]; k < r.stack_start[s + 1]; k++)
            fr[n++] = r.addrs[r.stack_addrs[k]].frame;
        st = cuma_stacks_stack(&b, fr, n, &renum[s]);
    }
    if (!st) {
        for (size_t i = 0; i < t->n; i++) t->stack[i] = renum[t->stack[i]];
        cuma_stacks_finish(&b, &t->stacks);
    } else {
        if (have_b) cuma_stacks_discard(&b);
        free(t->stack);
        t->stack = NULL;
    }
    free(renum);
    for (size_t i = 0; i < r.nmods; i++) free(r.mods[i].path);
    for (size_t i = 0; i < r.nnamed; i++) free(r.named[i].file);
    free(r.named);
    free(r.mods);
    free(r.addrs);
    free(r.stack_addrs);
    free(r.stack_start);
    free(path);
    return st;
}
