// SPDX-License-Identifier: Apache-2.0
/* `cuma plot`: replay timelines (timeline.h) drawn as one self-contained SVG figure.
 *
 * One panel per timeline, stacked: requested bytes as a filled area, reserved as a line, cached
 * dashed, and the reserved line of every --compare timeline of the same name. A timeline holds
 * levels that last until the next row (the replay's step function), so every series is drawn
 * as steps: a row k > 0 adds the point (t_k, v_{k-1}) before (t_k, v_k), 2n - 1 points for n
 * rows. The ratios in a panel's title are computed from the rows the same way, so they are the
 * replay's figures up to the sampling (docs/PLOTS.md).
 *
 * All input is read and checked before anything is written: a bad file leaves no figure.
 */
#include "cli.h"
#include "plot_html.h"
#include "timeline.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define FIG_W       960.0
#define PLOT_LEFT   80.0 /* room for the y tick labels and the unit */
#define PLOT_RIGHT  940.0
#define PLOT_H      220.0
#define FIG_TITLE_H 36.0
#define TITLE_H     28.0 /* a panel's title line */
#define LEGEND_ROW  16.0
#define AXIS_H      46.0 /* below the plot area: tick labels and the axis title */
#define CHAR_W      6.2  /* mean width of an 11 px sans-serif character, for the legend layout */

/* Colours of the --compare lines, in order (then again). */
static const char *const compare_colors[] = {"#1f77b4", "#9467bd", "#ff7f0e", "#8c564b"};
#define NCOLORS (sizeof compare_colors / sizeof compare_colors[0])

typedef struct compare {
    const char *name; /* the NAME of --compare NAME=FILE (a copy) */
    tl_series s;
} compare;

typedef struct plot_args {
    const char *out, *title;
    compare *cmp;
    int ncmp;
    const char **files;
    int nfiles;
    int html;   /* --html: the files are one trace, drawn as an interactive page */
    int device; /* --device (--html): a snapshot's device, -1 the one with most events */
} plot_args;

/* What a timeline says about itself: its peaks and the time integrals of its steps. */
typedef struct summary {
    double peak_req, peak_res, peak_ratio, avg_ratio; /* ratios < 0: undefined */
} summary;

typedef struct axis {
    double lo, hi, step; /* shown range and tick spacing, in the axis' unit */
    int decimals;        /* of the tick labels */
} axis;

/* ---- figures from a timeline ---------------------------------------------------------------- */

static summary summarize(const tl_series *s) {
    summary m = {0, 0, -1, -1};
    double area_req = 0, area_res = 0;
    for (size_t k = 0; k < s->n; k++) {
        const tl_row *r = &s->rows[k];
        if (r->requested > m.peak_req) m.peak_req = r->requested;
        if (r->reserved > m.peak_res) m.peak_res = r->reserved;
        if (k + 1 < s->n) {
            double dt = s->rows[k + 1].t - r->t;
            area_req += r->requested * dt;
            area_res += r->reserved * dt;
        }
    }
    if (m.peak_req > 0) m.peak_ratio = m.peak_res / m.peak_req;
    /* Huge byte counts times long spans can overflow to inf: no ratio then, rather than NaN. */
    if (area_req > 0 && isfinite(area_req) && isfinite(area_res)) m.avg_ratio = area_res / area_req;
    return m;
}

static void format_ratio(char *buf, size_t len, double ratio) {
    if (ratio < 0 || !isfinite(ratio))
        snprintf(buf, len, "n/a");
    else
        snprintf(buf, len, "%.4f", ratio);
}

/* The part of a path that names its trace: the base name without .csv and .timeline. */
static size_t stem(const char *path, const char **start) {
    const char *slash = strrchr(path, '/');
    *start = slash ? slash + 1 : path;
    size_t len = strlen(*start);
    if (len > 4 && !strncmp(*start + len - 4, ".csv", 4)) len -= 4;
    if (len > 9 && !strncmp(*start + len - 9, ".timeline", 9)) len -= 9;
    return len;
}

static int same_stem(const char *a, const char *b) {
    const char *sa, *sb;
    size_t la = stem(a, &sa), lb = stem(b, &sb);
    return la == lb && !strncmp(sa, sb, la);
}

/* ---- axes ------------------------------------------------------------------------------------ */

/* 1, 2 or 5 times a power of ten, near range / 5: four to ten round ticks. */
static double nice_step(double range) {
    double raw = range / 5, mag = pow(10, floor(log10(raw))), norm = raw / mag;
    return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
}

static int decimals_of(double step) {
    if (step >= 1) return 0;
    int d = (int)ceil(-log10(step) - 1e-9);
    return d > 12 ? 12 : d;
}

/* y from 0 to the first tick at or above max (max > 0). */
static axis y_axis(double max) {
    axis a = {0, max, nice_step(max), 0};
    a.hi = ceil(max / a.step) * a.step;
    if (a.hi < max) a.hi += a.step; /* rounding in the division */
    a.decimals = decimals_of(a.step);
    return a;
}

/* x over [lo, hi] exactly (the data's span), ticks at the multiples of the step inside it. */
static axis x_axis(double lo, double hi) {
    if (!(hi > lo)) { /* one instant: half a second either side */
        lo -= 0.5;
        hi += 0.5;
    }
    axis a = {lo, hi, 1, 0};
    if (hi > lo) a.step = nice_step(hi - lo);
    a.decimals = decimals_of(a.step);
    return a;
}

/* The byte unit that makes max at least 1 (B up to EiB). */
static double byte_unit(double max, const char **name) {
    static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double unit = 1;
    int i = 0;
    while (i < 6 && max >= unit * 1024) {
        unit *= 1024;
        i++;
    }
    *name = names[i];
    return unit;
}

/* ---- SVG output ------------------------------------------------------------------------------ */

static void put_escaped(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&':
            fputs("&amp;", f);
            break;
        case '<':
            fputs("&lt;", f);
            break;
        case '>':
            fputs("&gt;", f);
            break;
        case '"':
            fputs("&quot;", f);
            break;
        default:
            /* XML 1.0 has no other control characters than tab and newlines. */
            fputc((unsigned char)*s < 0x20 ? '?' : *s, f);
        }
    }
}

static void text(FILE *f, double x, double y, const char *attrs, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void text(FILE *f, double x, double y, const char *attrs, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" %s>", x, y, attrs);
    put_escaped(f, buf);
    fputs("</text>\n", f);
}

/* Where a panel's plot area lies and what its axes show. */
typedef struct frame {
    double left, top, width, height;
    axis x, y;
    double unit; /* bytes per y unit */
} frame;

static double px(const frame *fr, double t) {
    double u = fr->x.hi > fr->x.lo ? (t - fr->x.lo) / (fr->x.hi - fr->x.lo) : 0;
    return fr->left + (u < 0 ? 0 : u > 1 ? 1 : u) * fr->width; /* clamped: rounding only */
}

static double py(const frame *fr, double bytes) {
    double u = bytes / fr->unit / fr->y.hi;
    return fr->top + fr->height * (1 - (u < 0 ? 0 : u > 1 ? 1 : u));
}

/* The step points of one column (0 requested, 1 reserved, 2 cached) of s. */
static double column(const tl_row *r, int col) {
    return col == 0 ? r->requested : col == 1 ? r->reserved : r->cached;
}

static void step_points(FILE *f, const frame *fr, const tl_series *s, int col) {
    for (size_t k = 0; k < s->n; k++) {
        double x = px(fr, s->rows[k].t);
        if (k) fprintf(f, " %.1f,%.1f", x, py(fr, column(&s->rows[k - 1], col)));
        fprintf(f, "%s%.1f,%.1f", k ? " " : "", x, py(fr, column(&s->rows[k], col)));
    }
}

static void polyline(FILE *f, const frame *fr, const tl_series *s, int col, const char *cls,
                     const char *style) {
    fprintf(f, "<polyline class=\"%s\" fill=\"none\" %s points=\"", cls, style);
    step_points(f, fr, s, col);
    fputs("\"/>\n", f);
    if (s->n == 1) /* one point draws nothing: mark it */
        fprintf(f, "<circle class=\"%s-point\" cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" %s/>\n", cls,
                px(fr, s->rows[0].t), py(fr, column(&s->rows[0], col)), style);
}

static void draw_axes(FILE *f, const frame *fr, const char *unit_name) {
    double bottom = fr->top + fr->height, right = fr->left + fr->width;
    int nt = (int)llround(fr->y.hi / fr->y.step);
    for (int k = 0; k <= nt && k <= 20; k++) {
        double v = k * fr->y.step, y = py(fr, v * fr->unit);
        fprintf(f,
                "<line class=\"grid\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                "stroke=\"#e0e0e0\"/>\n",
                fr->left, y, right, y);
        text(f, fr->left - 6, y + 4, "class=\"ytick\" text-anchor=\"end\"", "%.*f", fr->y.decimals,
             v);
    }
    /* Ticks by a bounded integer count: at times past 2^53 us a double no longer moves by one
     * step (k + 1 == k), and a loop on the value would never end. */
    double k0 = ceil(fr->x.lo / fr->x.step), last = -INFINITY;
    for (int i = 0; i <= 20; i++) {
        double v = (k0 + i) * fr->x.step, x = px(fr, v);
        if (v > fr->x.hi) break;
        if (v < fr->x.lo || v <= last) continue;
        last = v;
        fprintf(f,
                "<line class=\"xgrid\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                "stroke=\"#e0e0e0\"/>\n",
                x, fr->top, x, bottom);
        text(f, x, bottom + 15, "class=\"xtick\" text-anchor=\"middle\"", "%.*f", fr->x.decimals,
             v);
    }
    text(f, fr->left + fr->width / 2, bottom + 34, "class=\"xlabel\" text-anchor=\"middle\"",
         "trace time (s)");
    text(f, 16, fr->top + fr->height / 2, "class=\"ylabel\" text-anchor=\"middle\"", "%s",
         unit_name);
    fprintf(f,
            "<rect class=\"plot-area\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
            "fill=\"none\" stroke=\"#444\"/>\n",
            fr->left, fr->top, fr->width, fr->height);
}

/* Legend entries, a line swatch and a label each, laid out left to right and wrapped at the
 * right edge. */
typedef struct legend {
    FILE *f; /* NULL: only measure the rows */
    double x, y, left;
    int rows;
} legend;

static void legend_entry(legend *lg, const char *style, const char *label) {
    double w = 26 + CHAR_W * (double)strlen(label) + 14;
    if (lg->x + w > PLOT_RIGHT && lg->x > lg->left) {
        lg->x = lg->left;
        lg->y += LEGEND_ROW;
        lg->rows++;
    }
    if (lg->f) {
        fprintf(lg->f,
                "<g class=\"legend-entry\"><line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                "y2=\"%.1f\" %s/>",
                lg->x, lg->y - 4, lg->x + 20, lg->y - 4, style);
        text(lg->f, lg->x + 26, lg->y, "class=\"legend\"", "%s", label);
        fputs("</g>\n", lg->f);
    }
    lg->x += w;
}

#define STYLE_REQUESTED "fill=\"#9ecae1\" fill-opacity=\"0.7\" stroke=\"none\""
#define STYLE_RESERVED  "stroke=\"#d62728\" stroke-width=\"1.5\""
#define STYLE_CACHED    "stroke=\"#2ca02c\" stroke-width=\"1.2\" stroke-dasharray=\"6,4\""

/* The first --compare with the same NAME as --compare c. */
static int first_of_name(const plot_args *a, int c) {
    int i = 0;
    while (strcmp(a->cmp[i].name, a->cmp[c].name)) i++;
    return i;
}

/* One colour per NAME, so that `--compare pytorch=...` on every panel reads as one series:
 * the NAMEs get the colours in the order they first appear. */
static void compare_style(const plot_args *a, int c, char *buf, size_t len) {
    int first = first_of_name(a, c), color = 0;
    for (int i = 0; i < first; i++) color += first_of_name(a, i) == i;
    snprintf(buf, len, "stroke=\"%s\" stroke-width=\"1.5\"", compare_colors[color % NCOLORS]);
}

/* The legend of panel p; returns its number of rows. f NULL: measures only. */
static int draw_legend(FILE *f, const plot_args *a, int p, double y) {
    legend lg = {f, PLOT_LEFT, y, PLOT_LEFT, 1};
    legend_entry(&lg, "stroke=\"#9ecae1\" stroke-width=\"8\"", "requested");
    legend_entry(&lg, STYLE_RESERVED, "reserved");
    legend_entry(&lg, STYLE_CACHED, "cached (idle, held)");
    for (int c = 0; c < a->ncmp; c++) {
        if (!same_stem(a->cmp[c].s.path, a->files[p])) continue;
        summary m = summarize(&a->cmp[c].s);
        char pk[32], av[32], label[512], style[64];
        format_ratio(pk, sizeof pk, m.peak_ratio);
        format_ratio(av, sizeof av, m.avg_ratio);
        snprintf(label, sizeof label, "%.200s reserved (peak %s, time-avg %s)", a->cmp[c].name, pk,
                 av);
        compare_style(a, c, style, sizeof style);
        legend_entry(&lg, style, label);
    }
    return lg.rows;
}

static double panel_height(const plot_args *a, int p) {
    return TITLE_H + LEGEND_ROW * draw_legend(NULL, a, p, 0) + 8 + PLOT_H + AXIS_H;
}

static void draw_panel(FILE *f, const plot_args *a, int p, const tl_series *s, double y0) {
    summary m = summarize(s);
    double tmin = s->rows[0].t, tmax = s->rows[s->n - 1].t, ymax = m.peak_res;
    for (size_t k = 0; k < s->n; k++) {
        if (s->rows[k].requested > ymax) ymax = s->rows[k].requested;
        if (s->rows[k].cached > ymax) ymax = s->rows[k].cached;
    }
    for (int c = 0; c < a->ncmp; c++) {
        const tl_series *cs = &a->cmp[c].s;
        if (!same_stem(cs->path, a->files[p])) continue;
        if (cs->rows[0].t < tmin) tmin = cs->rows[0].t;
        if (cs->rows[cs->n - 1].t > tmax) tmax = cs->rows[cs->n - 1].t;
        for (size_t k = 0; k < cs->n; k++)
            if (cs->rows[k].reserved > ymax) ymax = cs->rows[k].reserved;
    }
    const char *unit_name;
    frame fr = {PLOT_LEFT,
                0,
                PLOT_RIGHT - PLOT_LEFT,
                PLOT_H,
                x_axis(tmin, tmax),
                {0, 1, 1, 0},
                byte_unit(ymax, &unit_name)};
    fr.y = y_axis(ymax > 0 ? ymax / fr.unit : 1);
    int legend_rows = draw_legend(NULL, a, p, 0);
    fr.top = y0 + TITLE_H + LEGEND_ROW * legend_rows + 8;

    const char *name;
    size_t name_len = stem(s->path, &name);
    char pk[32], av[32];
    format_ratio(pk, sizeof pk, m.peak_ratio);
    format_ratio(av, sizeof av, m.avg_ratio);
    fprintf(f, "<g class=\"panel\" data-file=\"");
    put_escaped(f, s->path);
    fprintf(f, "\" data-rows=\"%zu\" data-peak-ratio=\"%s\" data-time-avg-ratio=\"%s\">\n", s->n,
            pk, av);
    text(f, PLOT_LEFT, y0 + 15, "class=\"panel-title\" font-weight=\"bold\" font-size=\"13\"",
         "%.*s: peak reserved / requested %s, time-averaged %s (%s)", (int)name_len, name, pk, av,
         strrchr(s->path, '/') ? strrchr(s->path, '/') + 1 : s->path);
    draw_legend(f, a, p, y0 + TITLE_H + 4);
    draw_axes(f, &fr, unit_name);

    /* The requested area: the step line closed along the x axis. */
    double base = fr.top + fr.height;
    fprintf(f, "<polygon class=\"requested\" " STYLE_REQUESTED " points=\"%.1f,%.1f ",
            px(&fr, s->rows[0].t), base);
    step_points(f, &fr, s, 0);
    fprintf(f, " %.1f,%.1f\"/>\n", px(&fr, s->rows[s->n - 1].t), base);
    polyline(f, &fr, s, 2, "cached", STYLE_CACHED);
    for (int c = 0; c < a->ncmp; c++) {
        if (!same_stem(a->cmp[c].s.path, a->files[p])) continue;
        char style[64];
        compare_style(a, c, style, sizeof style);
        fprintf(f, "<g class=\"compare-series\" data-name=\"");
        put_escaped(f, a->cmp[c].name);
        fputs("\">\n", f);
        polyline(f, &fr, &a->cmp[c].s, 1, "compare", style);
        fputs("</g>\n", f);
    }
    polyline(f, &fr, s, 1, "reserved", STYLE_RESERVED); /* on top: the figure that matters */
    fputs("</g>\n", f);
}

static void draw_figure(FILE *f, const plot_args *a, const tl_series *panels) {
    double h = FIG_TITLE_H;
    for (int p = 0; p < a->nfiles; p++) h += panel_height(a, p);
    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
            "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            FIG_W, h, FIG_W, h);
    text(f, FIG_W / 2, 24, "class=\"figure-title\" text-anchor=\"middle\" font-size=\"15\"", "%s",
         a->title);
    double y = FIG_TITLE_H;
    for (int p = 0; p < a->nfiles; p++) {
        draw_panel(f, a, p, &panels[p], y);
        y += panel_height(a, p);
    }
    fputs("</svg>\n", f);
}

/* ---- the command ----------------------------------------------------------------------------- */

static int parse_args(int argc, char **argv, plot_args *a, char **cmp_files) {
    int only_files = 0;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *v;
        int missing = 0;
        if (only_files || arg[0] != '-' || !arg[1]) {
            a->files[a->nfiles++] = arg;
        } else if (!strcmp(arg, "--")) {
            only_files = 1;
        } else if ((v = cli_option(argc, argv, &i, "-o", &missing)) != NULL ||
                   (v = cli_option(argc, argv, &i, "--output", &missing)) != NULL) {
            if (!*v) return cli_usage_error("plot", CUMA_PLOT_USAGE, "-o wants a file name");
            a->out = v;
        } else if (!strcmp(arg, "--html")) {
            a->html = 1;
        } else if ((v = cli_option(argc, argv, &i, "--device", &missing)) != NULL) {
            char *end;
            errno = 0;
            long d = strtol(v, &end, 10);
            if (!*v || *end || errno || d < 0 || d > 1023)
                return cli_usage_error("plot", CUMA_PLOT_USAGE,
                                       "--device wants a device number 0 to 1023, not '%s'", v);
            a->device = (int)d;
        } else if ((v = cli_option(argc, argv, &i, "--title", &missing)) != NULL) {
            a->title = v;
        } else if ((v = cli_option(argc, argv, &i, "--compare", &missing)) != NULL) {
            const char *eq = strchr(v, '=');
            if (!eq || eq == v || !eq[1])
                return cli_usage_error("plot", CUMA_PLOT_USAGE,
                                       "--compare wants NAME=TIMELINE.csv, not '%s'", v);
            /* NAME ends at the '=': cut it there in a copy, argv stays as it was. */
            char *name = strndup(v, (size_t)(eq - v));
            if (!name) return cli_usage_error("plot", CUMA_PLOT_USAGE, "out of memory");
            a->cmp[a->ncmp].name = name;
            cmp_files[a->ncmp++] = (char *)(eq + 1);
        } else if (missing) {
            return cli_usage_error("plot", CUMA_PLOT_USAGE, "%s needs a value", arg);
        } else {
            return cli_usage_error("plot", CUMA_PLOT_USAGE, "unknown option '%s'", arg);
        }
    }
    if (!a->nfiles)
        return cli_usage_error("plot", CUMA_PLOT_USAGE,
                               a->html ? "no trace given" : "no timeline given");
    if (a->html && a->nfiles != 1)
        return cli_usage_error("plot", CUMA_PLOT_USAGE, "--html draws one trace, not %d",
                               a->nfiles);
    if (a->html && a->ncmp)
        return cli_usage_error("plot", CUMA_PLOT_USAGE,
                               "--html draws one trace, without --compare");
    if (!a->html && a->device >= 0)
        return cli_usage_error("plot", CUMA_PLOT_USAGE, "--device goes with --html");
    return CUMA_EXIT_OK;
}

/* Reads every file, then checks that each --compare has a panel. */
static int read_all(const plot_args *a, char **cmp_files, tl_series *panels) {
    for (int p = 0; p < a->nfiles; p++) {
        int rc = tl_read("cuma plot", a->files[p], &panels[p]);
        if (rc != CUMA_EXIT_OK) return rc;
    }
    for (int c = 0; c < a->ncmp; c++) {
        int rc = tl_read("cuma plot", cmp_files[c], &a->cmp[c].s);
        if (rc != CUMA_EXIT_OK) return rc;
        int found = 0;
        for (int p = 0; p < a->nfiles && !found; p++) found = same_stem(cmp_files[c], a->files[p]);
        if (!found) {
            const char *st;
            size_t len = stem(cmp_files[c], &st);
            cli_eprintf(
                "cuma plot: --compare %s=%s: no timeline named %.*s to draw it on (a compared "
                "file is matched by its name: NAME.timeline.csv in another folder)\n",
                a->cmp[c].name, cmp_files[c], (int)len, st);
            return CUMA_EXIT_USAGE;
        }
    }
    return CUMA_EXIT_OK;
}

static int write_figure(const plot_args *a, const tl_series *panels) {
    FILE *f = a->out ? fopen(a->out, "w") : stdout;
    if (!f) {
        cli_eprintf("cuma plot: cannot write %s: %s\n", a->out, strerror(errno));
        return CUMA_EXIT_USAGE;
    }
    draw_figure(f, a, panels);
    int bad = ferror(f);
    if (a->out ? fclose(f) != 0 : fflush(f) != 0) bad = 1;
    if (bad) {
        cli_eprintf("cuma plot: error writing %s\n", a->out ? a->out : "stdout");
        if (a->out) remove(a->out);
        return CUMA_EXIT_FAIL;
    }
    return CUMA_EXIT_OK;
}

int cuma_cmd_plot(int argc, char **argv) {
    if (cli_wants_help(argc, argv, CUMA_PLOT_USAGE)) return CUMA_EXIT_OK;
    plot_args a = {.title = "cuma replay: requested and reserved memory over trace time",
                   .device = -1};
    a.files = calloc((size_t)argc, sizeof *a.files);
    a.cmp = calloc((size_t)argc, sizeof *a.cmp);
    char **cmp_files = calloc((size_t)argc, sizeof *cmp_files);
    tl_series *panels = calloc((size_t)argc, sizeof *panels);
    int rc = a.files && a.cmp && cmp_files && panels
                 ? parse_args(argc, argv, &a, cmp_files)
                 : cli_usage_error("plot", CUMA_PLOT_USAGE, "out of memory");
    if (rc == CUMA_EXIT_OK && a.html) {
        rc = plot_html(a.out, a.title, a.files[0], a.device, 0);
    } else if (rc == CUMA_EXIT_OK) {
        rc = read_all(&a, cmp_files, panels);
        if (rc == CUMA_EXIT_OK) rc = write_figure(&a, panels);
    }
    for (int i = 0; panels && i < a.nfiles; i++) tl_series_free(&panels[i]);
    for (int c = 0; a.cmp && c < a.ncmp; c++) {
        free((char *)a.cmp[c].name);
        tl_series_free(&a.cmp[c].s);
    }
    free(panels);
    free(cmp_files);
    free(a.cmp);
    free(a.files);
    return rc;
}
