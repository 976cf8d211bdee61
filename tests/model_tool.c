/* model_tool: drives the forward pass from a small script, so pytest can compare logits,
 * captured attention, prefix reuse, branches and the intervention against the numpy oracle.
 *
 *   model_tool -m MODEL -o OUTDIR [-t THREADS] [--batch T] [--ctx N] [--max-logits N]
 *              [--positions] [--moice SIDECAR] < SCRIPT
 *
 * --positions creates the forward with the position methods (ms_poe; moice with --moice, whose
 * sidecar is checked against the model file first); the first JSON line then carries the
 * Ms-PoE head ranks ("ms_poe_ranks", L x H).
 *
 * Prints one JSON line describing the model, then one per `run`. Script lines:
 *   kv NAME ROWS                 create a KV cache of ROWS rows (empty, at position 0)
 *   rebase NAME POS              empty NAME and make it a branch starting at POS
 *   truncate NAME POS            forget NAME's positions >= POS
 *   passes NAME N [ROWS]         give NAME N passes (attention_buckets runs N buckets) of at
 *                                least ROWS rows (default: NAME's)
 *   run NAME POS0 ids=I,J,.. [prefix=BASE] [logits=N] [out=TAG] [rows=P,Q,..]
 *       [spans=S:E,..] [probs] [post] [iv_spans=S:E,..] [iv_alpha=A,..] [iv_from=P]
 *       [iv_layers=L1,L2,..] [path=auto|batch|step] [pos=none|moice|ms_poe|...]
 * A run with out=TAG writes OUTDIR/TAG.logits (n_logits, V), TAG.mass (rows, L, H, spans) and
 * TAG.probs (rows, L, H, max row + 1), raw little-endian float32. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cpu.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "model/moice.h"

#define MAX_KV 16
#define MAX_LIST 65536

typedef struct {
    char name[64];
    fitm_kv *kv;
} named_kv;

static named_kv kvs[MAX_KV];
static int n_kvs;

static fitm_kv *find_kv(const char *name)
{
    for (int i = 0; i < n_kvs; i++)
        if (!strcmp(kvs[i].name, name))
            return kvs[i].kv;
    return NULL;
}

static int64_t parse_i64_list(const char *s, int64_t *out, int64_t cap)
{
    int64_t n = 0;
    while (*s && n < cap) {
        char *end;
        out[n++] = strtoll(s, &end, 10);
        if (end == s)
            return -1;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

static int64_t parse_spans(const char *s, fitm_span *out, int64_t cap)
{
    int64_t n = 0;
    while (*s && n < cap) {
        char *end;
        out[n].start = strtoll(s, &end, 10);
        if (*end != ':')
            return -1;
        out[n].end = strtoll(end + 1, &end, 10);
        n++;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

static int write_f32(const char *dir, const char *tag, const char *ext, const float *v, size_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.%s", dir, tag, ext);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(v, sizeof(float), n, f) != n) {
        fprintf(stderr, "model_tool: cannot write %s: %s\n", path, strerror(errno));
        if (f)
            fclose(f);
        return -1;
    }
    return fclose(f);
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *outdir = ".", *moice_path = NULL;
    bool positions = false;
    int threads = 2;
    int64_t batch = 512, ctx = 2048, max_logits = 512;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc)
            model_path = argv[++i];
        else if (!strcmp(argv[i], "-o") && i + 1 < argc)
            outdir = argv[++i];
        else if (!strcmp(argv[i], "-t") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc)
            batch = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc)
            ctx = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--max-logits") && i + 1 < argc)
            max_logits = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--moice") && i + 1 < argc)
            moice_path = argv[++i];
        else if (!strcmp(argv[i], "--positions"))
            positions = true;
        else {
            fprintf(stderr, "usage: model_tool -m MODEL -o OUTDIR [-t N] [--batch T] [--ctx N] "
                            "[--max-logits N] < SCRIPT\n");
            return 2;
        }
    }
    if (!model_path) {
        fprintf(stderr, "model_tool: -m MODEL is required\n");
        return 2;
    }
    if (max_logits > batch)
        max_logits = batch;
    fitm_err err = {{0}};
    fitm_model *m = NULL;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_moice *mo = NULL;
    fitm_status s = fitm_model_open(&m, model_path, &err);
    if (!s)
        s = fitm_backend_cpu_create(&b, threads, &err);
    if (!s && moice_path) {
        fitm_moice_base id;
        if (!(s = fitm_moice_load(&mo, moice_path, &err)) &&
            !(s = fitm_moice_model_identity(m, model_path, &id, &err)))
            s = fitm_moice_check(mo, &id, &err);
    }
    fitm_forward_params fp = {batch, ctx, max_logits};
    if (!s)
        s = fitm_forward_create(&fw, m, b, &fp, &err);
    if (!s && positions)
        s = fitm_forward_positions(fw, mo, &err);
    if (s) {
        fprintf(stderr, "model_tool: %s: %s\n", fitm_status_name(s), err.msg);
        fitm_moice_destroy(mo);
        fitm_model_close(m);
        fitm_backend_destroy(b);
        return 1;
    }
    const fitm_model_config *c = fitm_model_config_of(m);
    printf("{\"arch\":\"%s\",\"L\":%d,\"C\":%d,\"H\":%d,\"Hkv\":%d,\"D\":%d,\"F\":%d,\"V\":%d,"
           "\"n_swa\":%d,\"local\":[",
           fitm_arch_name(c->arch), c->n_layer, c->n_embd, c->n_head, c->n_head_kv, c->head_dim,
           c->n_ff, c->n_vocab, c->n_swa);
    for (int32_t l = 0; l < c->n_layer; l++)
        printf("%s%d", l ? "," : "", fitm_model_layer(m, l)->local ? 1 : 0);
    printf("],\"cpu\":\"%s\"", fitm_cpu_path_name(fitm_cpu_path()));
    if (positions) {
        const int32_t *rk = fitm_forward_ms_poe_ranks(fw);
        printf(",\"ms_poe_ranks\":[");
        for (int32_t l = 0; l < c->n_layer; l++) {
            printf("%s[", l ? "," : "");
            for (int32_t h = 0; h < c->n_head; h++)
                printf("%s%d", h ? "," : "", (int)rk[l * c->n_head + h]);
            printf("]");
        }
        printf("]");
    }
    printf("}\n");
    fflush(stdout);

    int64_t *ids64 = malloc(MAX_LIST * sizeof *ids64);
    int32_t *ids = malloc(MAX_LIST * sizeof *ids);
    int64_t *rows = malloc(MAX_LIST * sizeof *rows);
    fitm_span *spans = malloc(FITM_FORWARD_MAX_SPANS * sizeof *spans);
    fitm_span *iv_spans = malloc(FITM_FORWARD_MAX_SPANS * sizeof *iv_spans);
    int64_t *tmp = malloc(MAX_LIST * sizeof *tmp);
    float *iv_alpha = malloc(FITM_FORWARD_MAX_SPANS * sizeof *iv_alpha);
    uint8_t *iv_layers = malloc((size_t)c->n_layer);
    size_t line_cap = 1 << 22;
    char *line = malloc(line_cap);
    int rc = 0;
    while (rc == 0 && fgets(line, (int)line_cap, stdin)) {
        char *save = NULL;
        char *cmd = strtok_r(line, " \t\r\n", &save);
        if (!cmd || cmd[0] == '#')
            continue;
        char *name = strtok_r(NULL, " \t\r\n", &save);
        char *num = strtok_r(NULL, " \t\r\n", &save);
        fitm_kv *kv = name ? find_kv(name) : NULL;
        if (!strcmp(cmd, "kv") && name && num && n_kvs < MAX_KV) {
            snprintf(kvs[n_kvs].name, sizeof kvs[n_kvs].name, "%s", name);
            s = fitm_kv_create(&kvs[n_kvs].kv, b, c, atoll(num), &err);
            if (!s)
                n_kvs++;
        } else if (!strcmp(cmd, "rebase") && kv && num) {
            s = fitm_kv_rebase(kv, atoll(num), &err);
        } else if (!strcmp(cmd, "passes") && kv && num) {
            const char *rows_arg = strtok_r(NULL, " \t\r\n", &save);
            s = fitm_kv_passes(kv, atoi(num), rows_arg ? atoll(rows_arg) : 0, &err);
        } else if (!strcmp(cmd, "truncate") && kv && num) {
            fitm_kv_truncate(kv, atoll(num));
        } else if (!strcmp(cmd, "run") && kv && num) {
            int64_t pos0 = atoll(num), T = 0, n_rows = 0, n_spans = 0, n_iv = 0, n_alpha = 0;
            const char *tag = NULL;
            fitm_forward_opts o = {0};
            fitm_capture cap = {0};
            fitm_intervention iv = {0};
            bool want_probs = false, post = false, have_iv = false;
            for (char *kvp; (kvp = strtok_r(NULL, " \t\r\n", &save));) {
                char *eq = strchr(kvp, '=');
                const char *v = eq ? eq + 1 : "";
                if (eq)
                    *eq = 0;
                if (!strcmp(kvp, "ids")) {
                    T = parse_i64_list(v, ids64, MAX_LIST);
                    for (int64_t i = 0; i < T; i++)
                        ids[i] = (int32_t)ids64[i];
                } else if (!strcmp(kvp, "prefix")) {
                    o.prefix = find_kv(v);
                } else if (!strcmp(kvp, "logits")) {
                    o.n_logits = atoll(v);
                } else if (!strcmp(kvp, "out")) {
                    tag = v;
                } else if (!strcmp(kvp, "rows")) {
                    n_rows = parse_i64_list(v, rows, MAX_LIST);
                } else if (!strcmp(kvp, "spans")) {
                    n_spans = parse_spans(v, spans, FITM_FORWARD_MAX_SPANS);
                } else if (!strcmp(kvp, "probs")) {
                    want_probs = true;
                } else if (!strcmp(kvp, "path")) {
                    o.path = !strcmp(v, "batch") ? FITM_PATH_BATCH
                             : !strcmp(v, "step") ? FITM_PATH_STEP : FITM_PATH_AUTO;
                } else if (!strcmp(kvp, "pos")) {
                    int pm = fitm_position_method_parse(v);
                    o.position = pm < 0 ? FITM_POSITION_COUNT : (fitm_position_method)pm;
                } else if (!strcmp(kvp, "post")) {
                    post = true;
                } else if (!strcmp(kvp, "iv_spans")) {
                    n_iv = parse_spans(v, iv_spans, FITM_FORWARD_MAX_SPANS);
                    have_iv = true;
                } else if (!strcmp(kvp, "iv_alpha")) {
                    n_alpha = 0;
                    for (const char *p = v; *p && n_alpha < FITM_FORWARD_MAX_SPANS;) {
                        char *end;
                        iv_alpha[n_alpha++] = strtof(p, &end);
                        p = *end == ',' ? end + 1 : end;
                        if (end == p && *p)
                            break;
                    }
                } else if (!strcmp(kvp, "iv_from")) {
                    iv.from_pos = atoll(v);
                } else if (!strcmp(kvp, "iv_layers")) {
                    int64_t n = parse_i64_list(v, tmp, MAX_LIST);
                    memset(iv_layers, 0, (size_t)c->n_layer);
                    for (int64_t i = 0; i < n; i++)
                        if (tmp[i] >= 0 && tmp[i] < c->n_layer)
                            iv_layers[tmp[i]] = 1;
                    iv.layers = iv_layers;
                } else {
                    fprintf(stderr, "model_tool: unknown run option '%s'\n", kvp);
                    rc = 2;
                }
            }
            if (rc || T <= 0 || n_rows < 0 || n_spans < 0 || n_iv < 0 ||
                (have_iv && n_alpha != n_iv)) {
                fprintf(stderr, "model_tool: bad run line\n");
                rc = 2;
                break;
            }
            int64_t stride = 0;
            for (int64_t r = 0; r < n_rows; r++)
                stride = rows[r] + 1 > stride ? rows[r] + 1 : stride;
            float *logits = o.n_logits > 0 ? malloc((size_t)(o.n_logits * c->n_vocab) * sizeof(float)) : NULL;
            size_t n_mass = (size_t)(n_rows * c->n_layer * c->n_head * n_spans);
            size_t n_probs = want_probs ? (size_t)(n_rows * c->n_layer * c->n_head * stride) : 0;
            float *mass = n_mass ? malloc(n_mass * sizeof(float)) : NULL;
            float *probs = n_probs ? malloc(n_probs * sizeof(float)) : NULL;
            o.logits = logits;
            if (n_rows > 0) {
                cap.rows = rows;
                cap.n_rows = (int32_t)n_rows;
                cap.spans = spans;
                cap.n_spans = (int32_t)n_spans;
                cap.span_mass = mass;
                cap.probs = probs;
                cap.probs_stride = stride;
                cap.after_intervention = post;
                o.capture = &cap;
            }
            if (have_iv) {
                iv.spans = iv_spans;
                iv.n_spans = (int32_t)n_iv;
                iv.alpha = iv_alpha;
                o.intervention = &iv;
            }
            s = fitm_forward_run(fw, kv, ids, T, pos0, &o, &err);
            if (!s) {
                printf("{\"run\":\"%s\",\"T\":%lld,\"pos0\":%lld,\"n_logits\":%lld,\"rows\":%lld,"
                       "\"spans\":%lld,\"stride\":%lld}\n",
                       tag ? tag : "", (long long)T, (long long)pos0, (long long)o.n_logits,
                       (long long)n_rows, (long long)n_spans, (long long)stride);
                fflush(stdout);
                if (tag && ((logits && write_f32(outdir, tag, "logits", logits,
                                                 (size_t)(o.n_logits * c->n_vocab))) ||
                            (mass && write_f32(outdir, tag, "mass", mass, n_mass)) ||
                            (probs && write_f32(outdir, tag, "probs", probs, n_probs))))
                    rc = 1;
            }
            free(logits);
            free(mass);
            free(probs);
        } else {
            fprintf(stderr, "model_tool: bad script line starting '%s'\n", cmd);
            rc = 2;
        }
        if (s) {
            fprintf(stderr, "model_tool: %s: %s\n", fitm_status_name(s), err.msg);
            printf("{\"error\":\"%s\"}\n", fitm_status_name(s));
            rc = 1;
        }
    }
    for (int i = 0; i < n_kvs; i++)
        fitm_kv_destroy(kvs[i].kv);
    free(line);
    free(ids64);
    free(ids);
    free(rows);
    free(spans);
    free(iv_spans);
    free(tmp);
    free(iv_alpha);
    free(iv_layers);
    fitm_forward_destroy(fw);
    fitm_moice_destroy(mo);
    fitm_backend_destroy(b);
    fitm_model_close(m);
    return rc;
}
