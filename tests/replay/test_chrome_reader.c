// SPDX-License-Identifier: Apache-2.0
/* Unit test of the torch.profiler Chrome trace reader behind cuma_trace_load_opts
 * (src/trace/chrome_trace.c), on files written here: kineto's layout and Chrome's array form,
 * gzip'd, with a byte-order mark, unsorted, with frees before allocations, several devices,
 * other events in between; and malformed ones (truncated at every byte, deep nesting, bad
 * numbers, limits), each refused with the line and offset. CSV logs that start with white
 * space still load as CSV, their lines counted from the file's start.
 *
 * usage: test_chrome_reader WORK_DIR   (a writable folder for the trace files)
 */
#include "check.h"
#include "trace/chrome_trace.h"
#include "trace/trace.h"

#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

static const char *work;

static const char *write_file(const char *name, const void *p, size_t n, int gz) {
    static char path[4096];
    snprintf(path, sizeof path, "%s/%s", work, name);
    if (gz) {
        gzFile f = gzopen(path, "wb");
        CHECK(f);
        CHECK(gzwrite(f, p, (unsigned)n) == (int)n);
        CHECK(gzclose(f) == Z_OK);
    } else {
        FILE *f = fopen(path, "wb");
        CHECK(f);
        CHECK(fwrite(p, 1, n, f) == n);
        CHECK(fclose(f) == 0);
    }
    return path;
}

static cuma_status load(const char *path, int device, size_t max_events, cuma_trace *t) {
    cuma_trace_opts o = {.device = device, .max_events = max_events};
    return cuma_trace_load_opts(path, &o, t);
}

static void has_error(const char *want) {
    if (!strstr(cuma_last_error(), want)) {
        fprintf(stderr, "wanted '%s' in: %s\n", want, cuma_last_error());
        abort();
    }
}

/* A memory event in kineto's layout (the fields in the order PyTorch adds them). */
static size_t mem(char *out, size_t cap, const char *ts, long long addr, long long bytes,
                  long long reserved, int type, int id) {
    return (size_t)snprintf(
        out, cap,
        "  {\"ph\": \"i\", \"cat\": \"cpu_instant_event\", \"s\": \"t\", "
        "\"name\": \"[memory]\", \"pid\": 7, \"tid\": 7, \"ts\": %s,\n"
        "   \"args\": {\"Device Type\": %d, \"Device Id\": %d, \"Addr\": %lld, "
        "\"Bytes\": %lld, \"Total Allocated\": 0, \"Total Reserved\": %lld}},\n",
        ts, type, id, addr, bytes, reserved);
}

/* Unsorted, fractional times, a free before any allocation, other events between, a CPU
 * event, two CUDA devices. */
static const char *kineto_text(void) {
    static char b[8192];
    size_t n = 0;
    n +=
        (size_t)snprintf(b + n, sizeof b - n,
                         "{\n  \"schemaVersion\": 1,\n  \"deviceProperties\": [{\"id\": 0, "
                         "\"name\": \"G\\u00e9\", \"nested\": [[[{\"x\": [true, false, null]}]]]}],"
                         "\n  \"traceEvents\": [\n"
                         "  {\"ph\": \"X\", \"cat\": \"cpu_op\", \"name\": \"aten::empty\", "
                         "\"ts\": 99.5, \"dur\": 3, \"args\": {\"Call stack\": \"a\\\\b\\\"c\", "
                         "\"Bytes\": \"not one\"}},\n");
    n += mem(b + n, sizeof b - n, "1000.250", 0x7f0000001000, 4096, 2097152, 1, 0);
    n += mem(b + n, sizeof b - n, "1000.125", 0x7f0000002000, -512, 2097152, 1, 0); /* before */
    n += mem(b + n, sizeof b - n, "1002", 0x7f0000001000, -4096, 2097152, 1, 0);
    n += mem(b + n, sizeof b - n, "1001.5e0", 0x7f0000003000, 1024, 6291456, 1, 0);
    n += mem(b + n, sizeof b - n, "1002", 0x7f0000001000, 2048, 6291456, 1, 0); /* tie: after */
    n += mem(b + n, sizeof b - n, "1001", 0x5000, 64, 0, 0, -1);
    n += mem(b + n, sizeof b - n, "1003", 0x7f0000009000, 128, 2097152, 1, 1);
    n += (size_t)snprintf(b + n, sizeof b - n,
                          "  {\"ph\": \"i\", \"name\": \"[OutOfMemory]\", \"ts\": 1004, "
                          "\"args\": {\"Device Type\": 1, \"Device Id\": 0, \"Bytes\": 999, "
                          "\"Total Reserved\": 6291456}},\n"
                          "  {\"ph\": \"f\", \"name\": \"flow\", \"ts\": 0, \"args\": {}}\n"
                          "  ],\n  \"traceName\": \"t.json\"\n}\n");
    CHECK(n < sizeof b);
    return b;
}

static void check_kineto(const cuma_trace *t) {
    CHECK(t->format == CUMA_TRACE_TORCH_PROFILER && t->device == 0 && !t->synthetic_times);
    /* The block from before (the free at 1000.125 of an address never allocated) comes first
     * at time 0; then by time: the free (t 0), the 4096 alloc (0.125 us: 0), the 1024 alloc
     * (1.375: 1), the 4096's free and the 2048 alloc at the same time in file order (1.875: 1),
     * the failed allocation (3.875: 3). */
    CHECK(t->n == 7 && t->preexisting == 1 && t->unmatched_frees == 0);
    const struct {
        uint32_t action;
        uint64_t ptr, size, time;
    } want[] = {
        {CUMA_TRACE_ALLOC, 0x7f0000002000, 512, 0},  {CUMA_TRACE_FREE, 0x7f0000002000, 512, 0},
        {CUMA_TRACE_ALLOC, 0x7f0000001000, 4096, 0}, {CUMA_TRACE_ALLOC, 0x7f0000003000, 1024, 1},
        {CUMA_TRACE_FREE, 0x7f0000001000, 4096, 1},  {CUMA_TRACE_ALLOC, 0x7f0000001000, 2048, 1},
        {CUMA_TRACE_ALLOC_FAIL, 0, 999, 3},
    };
    for (size_t i = 0; i < 7; i++) {
        const cuma_trace_event *e = &t->ev[i];
        if (e->action != want[i].action || e->ptr != want[i].ptr || e->size != want[i].size ||
            e->time_us != want[i].time) {
            fprintf(stderr, "event %zu: %u %llx %llu at %llu\n", i, e->action,
                    (unsigned long long)e->ptr, (unsigned long long)e->size,
                    (unsigned long long)e->time_us);
            abort();
        }
    }
    CHECK(t->ev[0].match == 1 && t->ev[2].match == 4 && t->ev[5].match == -1);
    /* Total Reserved: 2 MiB until 1001.5, then 6 MiB until 1004 (the CPU and device 1 events do
     * not count): peak 6 MiB, average (1.375 * 2 + 2.5 * 6) / 3.875 MiB. */
    CHECK(t->recorded.valid && t->recorded.peak_reserved == 6291456);
    double avg = (1.375 * 2 + 2.5 * 6) / 3.875 * 1048576;
    CHECK(t->recorded.has_time_avg && t->recorded.time_avg_reserved > avg - 2 &&
          t->recorded.time_avg_reserved < avg + 2);
}

static void test_kineto(void) {
    const char *text = kineto_text();
    cuma_trace t;
    CHECK_OK(load(write_file("k.json", text, strlen(text), 0), -1, 0, &t));
    check_kineto(&t);
    CHECK(!strcmp(t.path + strlen(t.path) - 6, "k.json"));
    cuma_trace_free(&t);
    CHECK_OK(load(write_file("k.json.gz", text, strlen(text), 1), -1, 0, &t));
    check_kineto(&t);
    cuma_trace_free(&t);
    /* A byte-order mark and blank lines before it, as some editors and tools leave them. */
    char b[9000];
    int n = snprintf(b, sizeof b, "\xEF\xBB\xBF\r\n\n \t%s", text);
    CHECK_OK(load(write_file("bom.json", b, (size_t)n, 0), -1, 0, &t));
    check_kineto(&t);
    cuma_trace_free(&t);
    /* Device 1 asked for: its one event; an absent one refused, naming those there are. */
    CHECK_OK(load(write_file("k.json", text, strlen(text), 0), 1, 0, &t));
    CHECK(t.device == 1 && t.n == 1 && t.ev[0].size == 128 && t.recorded.valid);
    cuma_trace_free(&t);
    CHECK_ST(load(write_file("k.json", text, strlen(text), 0), 4, 0, &t), CUMA_ERR_INVALID);
    has_error("no device 4: the trace has CUDA memory events of device(s) 0 1");
    CHECK(!t.ev && !t.n && !t.path);
    /* The limit counts the memory events read (8 here, of every device). */
    CHECK_ST(load(write_file("k.json", text, strlen(text), 0), -1, 7, &t), CUMA_ERR_LIMIT);
    has_error("more than 7 memory events, the reader's limit");
}

/* Chrome's array form, CPU events only: those are taken, device -1, no recorded figures. */
static void test_array_cpu(void) {
    char b[4096];
    size_t n = 0;
    n += (size_t)snprintf(b + n, sizeof b - n, "[");
    n += mem(b + n, sizeof b - n, "5", 0x1000, 100, 0, 0, -1);
    n += mem(b + n, sizeof b - n, "7", -4096, 200, 0, 0, -1); /* an intptr_t's bits */
    n += mem(b + n, sizeof b - n, "6", 0x1000, -100, 0, 0, -1);
    n += mem(b + n, sizeof b - n, "8", 0x1000, 0, 0, 0, -1); /* zero bytes: nothing */
    n += (size_t)snprintf(b + n, sizeof b - n, "{\"name\": \"x\", \"ts\": 1}]");
    cuma_trace t;
    CHECK_OK(load(write_file("cpu.json", b, n, 0), -1, 0, &t));
    CHECK(t.format == CUMA_TRACE_TORCH_PROFILER && t.device == -1 && !t.recorded.valid);
    CHECK(t.n == 3 && !t.preexisting);
    CHECK(t.ev[0].action == CUMA_TRACE_ALLOC && t.ev[1].action == CUMA_TRACE_FREE &&
          t.ev[1].match == 0 && t.ev[1].time_us == 1);
    CHECK(t.ev[2].ptr == (uint64_t)-4096 && t.ev[2].time_us == 2);
    cuma_trace_free(&t);
    CHECK_ST(load(write_file("cpu.json", b, n, 0), 0, 0, &t), CUMA_ERR_INVALID);
    has_error("no device 0: the trace has no CUDA memory events (4 CPU ones)");
}

/* A body of one memory event's args with `args` spliced in, read from bytes. */
static cuma_status one(const char *ts, const char *args, cuma_trace *t) {
    char b[1 << 13];
    int n = snprintf(b, sizeof b,
                     "{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": %s, \"args\": {%s}}]}",
                     ts, args);
    CHECK(n > 0 && (size_t)n < sizeof b);
    return cuma_chrome_from_bytes((const uint8_t *)b, (size_t)n, "m.json", 100, -1, t);
}

#define DEV "\"Device Type\": 1, \"Device Id\": 0, "

static void test_numbers(void) {
    cuma_trace t;
    /* Exponents and zeros that are whole numbers; a time in ns beyond a double's precision. */
    CHECK_OK(one("1733000000000000.125", DEV "\"Addr\": 1.6e1, \"Bytes\": 2.50e2", &t));
    CHECK(t.n == 1 && t.ev[0].ptr == 16 && t.ev[0].size == 250);
    cuma_trace_free(&t);
    CHECK_OK(one("-5", DEV "\"Addr\": 18446744073709551615, \"Bytes\": 9223372036854775807", &t));
    CHECK(t.ev[0].ptr == UINT64_MAX && t.ev[0].size == (uint64_t)INT64_MAX);
    cuma_trace_free(&t);
    const struct {
        const char *ts, *args, *err;
        cuma_status st;
    } bad[] = {
        {"1", DEV "\"Addr\": 16, \"Bytes\": 1.5", "'Bytes' is not a whole number", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 16, \"Bytes\": 1e30", "'Bytes' is not from", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 16, \"Bytes\": -9223372036854775808", "not from", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 1e20, \"Bytes\": 1", "'Addr' is not a 64-bit", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": \"0x10\", \"Bytes\": 1", "not a number: 'Addr'", CUMA_ERR_PARSE},
        {"1", DEV "\"Bytes\": 1", "no 'Addr'", CUMA_ERR_PARSE},
        {"1", "\"Device Id\": 0, \"Addr\": 1, \"Bytes\": 1", "no 'Device Type' (offset 17)",
         CUMA_ERR_PARSE},
        {"1", "\"Device Type\": 1, \"Device Id\": 1024, \"Addr\": 1, \"Bytes\": 1",
         "'Device Id' is not from -1 to 1023", CUMA_ERR_PARSE},
        {"1e400", DEV "\"Addr\": 1, \"Bytes\": 1", "'ts' is out of range", CUMA_ERR_PARSE},
        {"\"1\"", DEV "\"Addr\": 1, \"Bytes\": 1", "not a number: 'ts'", CUMA_ERR_PARSE},
        {"01", DEV "\"Addr\": 1, \"Bytes\": 1", "leading zero", CUMA_ERR_PARSE},
        {"1.", DEV "\"Addr\": 1, \"Bytes\": 1", "no digit after its '.'", CUMA_ERR_PARSE},
        {"1e+", DEV "\"Addr\": 1, \"Bytes\": 1", "no digit in its exponent", CUMA_ERR_PARSE},
        {"-", DEV "\"Addr\": 1, \"Bytes\": 1", "a number without digits", CUMA_ERR_PARSE},
        {"+1", DEV "\"Addr\": 1, \"Bytes\": 1", "expected a value, found '+'", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 1, \"Bytes\": 1, \"x\": \"\\q\"", "unknown escape", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 1, \"Bytes\": 1, \"x\": \"\\u12g4\"", "four hex", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 1, \"Bytes\": 1, \"x\": \"a\tb\"", "control byte 0x09",
         CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 1, \"Bytes\": 1, \"x\": tru", "expected a value", CUMA_ERR_PARSE},
        {"1", DEV "\"Addr\": 1, \"Bytes\": 1,", "expected a key string", CUMA_ERR_PARSE},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cuma_status st = one(bad[i].ts, bad[i].args, &t);
        if (st != bad[i].st || !strstr(cuma_last_error(), bad[i].err)) {
            fprintf(stderr, "case %zu (%s | %s): %s: %s\n", i, bad[i].ts, bad[i].args,
                    cuma_status_string(st), cuma_last_error());
            abort();
        }
        CHECK(!t.ev && !t.n && !t.path);
        has_error("m.json:1: ");
        has_error("(offset ");
    }
    /* A number longer than the limit, though valid. */
    char longnum[400];
    memset(longnum, '7', 300);
    longnum[300] = 0;
    CHECK_ST(one(longnum, DEV "\"Addr\": 1, \"Bytes\": 1", &t), CUMA_ERR_LIMIT);
    has_error("a number of more than 256 characters");
}

/* Every strict prefix of a valid trace is refused cleanly; the whole one is read. */
static void test_truncated(void) {
    const char *text = kineto_text();
    size_t len = strlen(text);
    while (len && (text[len - 1] == '\n' || text[len - 1] == ' ')) len--;
    cuma_trace t;
    for (size_t n = 0; n < len; n++) {
        cuma_status st = cuma_chrome_from_bytes((const uint8_t *)text, n, "cut.json", 100, -1, &t);
        if (st != CUMA_ERR_PARSE) {
            fprintf(stderr, "prefix of %zu bytes: %s: %s\n", n, cuma_status_string(st),
                    cuma_last_error());
            abort();
        }
        CHECK(!t.ev && !t.path);
    }
    CHECK_OK(cuma_chrome_from_bytes((const uint8_t *)text, len, "whole.json", 100, -1, &t));
    check_kineto(&t);
    cuma_trace_free(&t);
    /* Cut inside the events array: the end of the file is named, with its line. */
    const char *cut = "{\"traceEvents\": [\n{\"name\": \"x\"},\n{\"name\": \"[mem";
    CHECK_ST(load(write_file("cut.json", cut, strlen(cut), 0), -1, 0, &t), CUMA_ERR_PARSE);
    has_error("cut.json:3: a string that does not end (truncated?) (offset 42)");
    /* A .gz file cut in its trailer decompresses to the whole JSON: zlib reports the cut only
     * through gzerror, which the reader must ask. */
    const char *gz = write_file("cut.json.gz", text, len, 1);
    struct stat sb;
    CHECK(stat(gz, &sb) == 0 && sb.st_size > 8 && truncate(gz, sb.st_size - 4) == 0);
    CHECK_ST(load(gz, -1, 0, &t), CUMA_ERR_IO);
    has_error("cut.json.gz: read failed: the compressed data ends early (a truncated file?)");
    CHECK(!t.ev && !t.path);
}

static void test_structure(void) {
    cuma_trace t;
    /* Nesting: 60 levels inside an event's args are fine, 70 are not. */
    char b[1024];
    for (int depth = 60; depth <= 70; depth += 10) {
        int m = snprintf(b, sizeof b,
                         "{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 1, "
                         "\"args\": {" DEV "\"Addr\": 1, \"Bytes\": 1, \"x\": ");
        for (int k = 0; k < depth - 4; k++) b[m++] = '[';
        for (int k = 0; k < depth - 4; k++) b[m++] = ']';
        m += snprintf(b + m, sizeof b - (size_t)m, "}}]}");
        cuma_status st = cuma_chrome_from_bytes((const uint8_t *)b, (size_t)m, "d", 10, -1, &t);
        if (depth == 60) {
            CHECK_OK(st);
            cuma_trace_free(&t);
        } else {
            CHECK(st == CUMA_ERR_LIMIT);
            has_error("more than 64 levels of nesting, the reader's limit");
        }
    }
    /* A deep nest of unclosed arrays ends at the limit, not at the stack's end. */
    static char deep[1 << 20];
    memcpy(deep, "{\"traceEvents\": [{\"args\": ", 26);
    memset(deep + 26, '[', sizeof deep - 26);
    CHECK_ST(cuma_chrome_from_bytes((const uint8_t *)deep, sizeof deep, "d", 10, -1, &t),
             CUMA_ERR_LIMIT);
    /* A string longer than 4 MiB. */
    size_t big = (4u << 20) + 64;
    char *s = malloc(big + 64);
    CHECK(s);
    int h = snprintf(s, 64, "[{\"name\": \"");
    memset(s + h, 'a', big);
    memcpy(s + h + big, "\"}]", 4);
    CHECK_ST(cuma_chrome_from_bytes((const uint8_t *)s, strlen(s), "s", 10, -1, &t),
             CUMA_ERR_LIMIT);
    has_error("a string of more than 4 MiB, the reader's limit");
    free(s);
    const struct {
        const char *text, *err;
    } bad[] = {
        {"{\"traceEvents\": []} x", "expected nothing after the JSON value, found 'x'"},
        {"{\"other\": []}", "a JSON object without 'traceEvents': not a Chrome trace"},
        {"{\"traceEvents\": {}}", "expected an array for 'traceEvents'"},
        {"{\"traceEvents\": [], \"traceEvents\": []}", "a second 'traceEvents'"},
        {"{\"traceEvents\": [1]}", "trace event 0 is not an object ('1')"},
        {"{\"traceEvents\": [{}, {} {}]}", "expected ',' or ']' after a trace event"},
        {"{\"traceEvents\": [{\"name\" 1}]}", "expected ':' after a key"},
        {"{\"traceEvents\": [{\"a\": 1 \"b\": 2}]}", "expected ',' or '}' in an object"},
        {"{\"traceEvents\": [{\"a\": [1 2]}]}", "expected ',' or ']' in an array"},
        {"{\"traceEvents\": [{\"a\": \x01}]}", "expected a value, found byte 0x01"},
        {"{\"traceEvents\": [{\"name\": \"aten::mm\", \"ts\": 3}]}",
         "a Chrome trace with no [memory] events among its 1 events"},
        {"[{\"name\": \"[memory]\"}]", "memory event 0: no 'ts'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cuma_status st = cuma_chrome_from_bytes((const uint8_t *)bad[i].text, strlen(bad[i].text),
                                                "b.json", 10, -1, &t);
        if (st != CUMA_ERR_PARSE || !strstr(cuma_last_error(), bad[i].err)) {
            fprintf(stderr, "case %zu (%s): %s: %s\n", i, bad[i].text, cuma_status_string(st),
                    cuma_last_error());
            abort();
        }
        CHECK(!t.ev && !t.path);
    }
}

/* The sniffing that tells JSON from CSV leaves CSV logs as they were read before. */
static void test_csv_still_csv(void) {
    const char *csv = "\n\n  Thread,Time,Action,Pointer,Size,Stream\n"
                      "0,00:00:00:000001,allocate,0x10,8,0\n";
    cuma_trace t;
    CHECK_OK(load(write_file("blank.csv", csv, strlen(csv), 0), -1, 0, &t));
    CHECK(t.format == CUMA_TRACE_RMM_CSV && t.n == 1 && t.ev[0].size == 8);
    cuma_trace_free(&t);
    const char *badcsv = "\xEF\xBB\xBF\n\nThread,Time,Action,Pointer,Size,Stream\n"
                         "0,00:00:00:000001,allocate,zz,8,0\n";
    CHECK_ST(load(write_file("bad.csv", badcsv, strlen(badcsv), 0), -1, 0, &t), CUMA_ERR_PARSE);
    has_error("bad.csv:4: bad pointer");
    const char *cut_bom = "\xEF\xBBThread";
    CHECK_ST(load(write_file("cutbom.csv", cut_bom, strlen(cut_bom), 0), -1, 0, &t),
             CUMA_ERR_PARSE);
    has_error("missing header");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_chrome_reader WORK_DIR\n");
        return 2;
    }
    work = argv[1];
    test_kineto();
    test_array_cpu();
    test_numbers();
    test_truncated();
    test_structure();
    test_csv_still_csv();
    printf("chrome trace reader: ok\n");
    return 0;
}
