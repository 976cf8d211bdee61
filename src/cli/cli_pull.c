/* cli_pull: `fitm pull URL -o FILE [--sha256 HEX]` — downloads a model the way fitmd's
 * model_url does (base/download.h: FILE.part, resume, retries, stall limit, checksum, atomic
 * rename), with a progress bar on a terminal and a line every few seconds otherwise. */
#include <curl/curl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/download.h"
#include "cli/cli.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: fitm pull URL -o FILE [options]\n"
            "  -o, --output FILE     where the file goes (written as FILE.part, renamed when\n"
            "                        complete and verified; an interrupted pull resumes)\n"
            "  --sha256 HEX          expected SHA-256 of the file (64 hex digits)\n"
            "  --retries N           further attempts after a failed one (default 5)\n"
            "  --stall-timeout S     abort an attempt that moved under 1 KiB/s for S seconds\n"
            "                        (default 30)\n"
            "  --backoff-ms MS       pause before the first retry, doubling (default 1000)\n"
            "  -q, --quiet           no progress\n"
            "exit status: 0 done, 1 failed (the reason on stderr), 2 usage error\n");
}

static void human(double b, char *out, size_t n)
{
    const char *u[] = {"B", "KB", "MB", "GB", "TB"};
    int i = 0;
    for (; b >= 1000 && i < 4; i++)
        b /= 1000;
    snprintf(out, n, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

typedef struct {
    bool tty;
    int64_t last_line_ns;
} progress_state;

/* A bar redrawn in place on a terminal; elsewhere (logs, CI) a line every 5 s and at the end. */
static void on_progress(const fitm_download_progress *p, void *arg)
{
    progress_state *ps = arg;
    char done[32], total[32], rate[32], eta[32] = "?";
    human((double)p->done, done, sizeof done);
    human((double)p->total, total, sizeof total);
    human(p->rate, rate, sizeof rate);
    if (p->eta_s >= 0)
        snprintf(eta, sizeof eta, "%dm%02ds", (int)(p->eta_s / 60), (int)p->eta_s % 60);
    int pct = p->total > 0 ? (int)(100 * (double)p->done / (double)p->total) : -1;
    if (ps->tty) {
        char bar[31];
        int fill = pct >= 0 ? pct * 30 / 100 : 0;
        for (int i = 0; i < 30; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[30] = '\0';
        fprintf(stderr, "\r[%s] %3d%%  %s / %s  %s/s  ETA %s   ", bar, pct < 0 ? 0 : pct, done,
                p->total >= 0 ? total : "?", rate, eta);
        if (p->final)
            fputc('\n', stderr);
        return;
    }
    int64_t now = fitm_clock_ns();
    if (!p->final && now - ps->last_line_ns < 5000000000LL)
        return;
    ps->last_line_ns = now;
    if (pct >= 0)
        fprintf(stderr, "pull: %d%% (%s of %s) at %s/s, ETA %s\n", pct, done, total, rate, eta);
    else
        fprintf(stderr, "pull: %s at %s/s\n", done, rate);
}

static bool parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

int fitm_cli_pull(int argc, char **argv)
{
    const char *url = NULL, *out = NULL;
    bool quiet = false;
    fitm_download_opts o;
    fitm_download_opts_init(&o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        long v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if ((!strcmp(a, "-o") || !strcmp(a, "--output")) && has_val) {
            out = argv[++i];
        } else if (!strcmp(a, "--sha256") && has_val) {
            o.sha256 = argv[++i];
        } else if (!strcmp(a, "--retries") && has_val && parse_int(argv[i + 1], 0, 1000, &v)) {
            o.retries = (int)v;
            i++;
        } else if (!strcmp(a, "--stall-timeout") && has_val &&
                   parse_int(argv[i + 1], 1, 86400, &v)) {
            o.stall_s = v;
            i++;
        } else if (!strcmp(a, "--backoff-ms") && has_val &&
                   parse_int(argv[i + 1], 0, 3600000, &v)) {
            o.backoff_ms = v;
            i++;
        } else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            quiet = true;
        } else if (a[0] != '-' && !url) {
            url = a;
        } else {
            fprintf(stderr, "fitm pull: bad or incomplete argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!url || !out) {
        fprintf(stderr, "fitm pull: %s\n", !url ? "no URL given" : "no output file (-o FILE)");
        usage(stderr);
        return 2;
    }
    progress_state ps = {.tty = isatty(STDERR_FILENO) == 1};
    if (!quiet) {
        o.progress = on_progress;
        o.progress_arg = &ps;
    }
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fprintf(stderr, "fitm pull: cannot initialise libcurl\n");
        return 1;
    }
    fitm_err err = {{0}};
    fitm_status st = fitm_download(url, out, &o, &err);
    curl_global_cleanup();
    if (st != FITM_OK) {
        fprintf(stderr, "fitm pull: %s\n", err.msg);
        return st == FITM_ERR_INVALID ? 2 : 1;
    }
    return 0;
}
