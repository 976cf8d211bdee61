/* backend_cpu: the reference backend. Ops from ops.c, matrix products from quant.c (quantized
 * dot products; fixed-order products over float tiles), attention with fixed-order kernels,
 * all split across a thread pool: matrix products by output rows, attention by (head, query
 * tile), row-wise ops by rows. Every output element is summed in an order independent of the
 * batch size and of how the work is split (see is_float_type and the attention section).
 *
 * Built once per SIMD path of base/cpu.h (src/model/meson.build gives each object its -march
 * and FITM_CPU_SUFFIX): fitm_backend_cpu_create_baseline/_avx2/_avx512, of which
 * backend_cpu_select.c calls the one the process runs. */
#ifndef FITM_CPU_SUFFIX
#error "backend_cpu.c is built once per SIMD path, with its -march and FITM_CPU_SUFFIX"
#endif
#include <assert.h>
#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>

#include "compute/simd_x86.h"
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/mem.h"
#include "base/pool.h"
#include "compute/quant.h"
#include "model/backend.h"

#define ALIGN 64
#define TILE_Q 32              /* query rows per attention task                      */
#define PAR_MIN_ELEMS 32768    /* element-wise ops smaller than this run inline       */
#define MAX_VEC_TYPES 3        /* distinct activation types in one matmul call        */
#define FLOAT_TILE 64          /* rows of a float weight converted to F32 at a time   */
#define PACK_ROWS 8            /* rows converted together, then stored K-major       */
#define MATVEC_TASK_BYTES 262144 /* least weight bytes per task of a one-row product */

/* A weight this path multiplies in quant.h's packed layout: a copy made by prepare, found by
 * the stored data's address (the fitm_weight view's, stable for the model's life). */
typedef struct {
    const void *stored;
    void *packed;
} packed_weight;

typedef struct {
    fitm_backend base;
    fitm_pool *pool;
    int n_threads;
    int64_t max_tokens, max_keys, max_k;
    float **scores;        /* per thread: (TILE_Q, max_keys)                 */
    float **mixed;         /* per thread: (TILE_Q, max_keys) a mixture's A   */
    double **mass;         /* per thread: (FITM_FORWARD_MAX_SPANS)           */
    float **mm_scratch;    /* per thread: (FLOAT_TILE + PACK_ROWS, max_k)    */
    float *zero_row;       /* (max_k) zeros: padding rows of the float path  */
    uint8_t *xq[MAX_VEC_TYPES]; /* quantized activations, (max_tokens, row)  */
    size_t xq_row_cap;     /* bytes of one quantized row the buffers allow   */
    packed_weight *packs;  /* packed copies of packed_model's weights, sorted by stored address */
    size_t n_packs;
    const fitm_model *packed_model; /* or NULL                                 */
    int64_t model_refs;    /* forwards of packed_model alive that prepared it */
} cpu_backend;

static cpu_backend *cpu(fitm_backend *b)
{
    return (cpu_backend *)b;
}

/* ---- memory ------------------------------------------------------------------------------ */

/* Page-backed for large buffers (base/mem.h): a KV cache sized for the whole context is
 * resident only for the rows it held, and a freed one leaves the process at once. */
static void *cpu_alloc(fitm_backend *b, size_t n)
{
    (void)b;
    return fitm_mem_alloc_zeroed((n + ALIGN - 1) / ALIGN * ALIGN, ALIGN);
}

static void cpu_free(fitm_backend *b, void *p)
{
    (void)b;
    fitm_mem_free(p);
}

static void cpu_copy(fitm_backend *b, void *dst, const void *src, size_t n)
{
    (void)b;
    if (n)
        memcpy(dst, src, n);
}

/* dst (n fp16) = src (n F32), rounded to nearest even as fitm_fp32_to_fp16 rounds. */
static void cpu_to_half(fitm_backend *b, void *dst, const float *src, int64_t n)
{
    (void)b;
    uint16_t *h = dst;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(h + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        h[i] = fitm_fp32_to_fp16(src[i]);
}

/* dst (n F32) = src (n fp16), exactly. */
static void cpu_from_half(fitm_backend *b, float *dst, const void *src, int64_t n)
{
    (void)b;
    const uint16_t *h = src;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++)
        dst[i] = fitm_fp16_to_fp32(h[i]);
}

static void free_per_thread(void **v, int n)
{
    if (!v)
        return;
    for (int i = 0; i < n; i++)
        cpu_free(NULL, v[i]);
    free(v);
}

static void release_scratch(cpu_backend *c)
{
    free_per_thread((void **)c->scores, c->n_threads);
    free_per_thread((void **)c->mixed, c->n_threads);
    free_per_thread((void **)c->mass, c->n_threads);
    free_per_thread((void **)c->mm_scratch, c->n_threads);
    cpu_free(NULL, c->zero_row);
    c->scores = NULL;
    c->mixed = NULL;
    c->mass = NULL;
    c->mm_scratch = NULL;
    c->zero_row = NULL;
    for (int i = 0; i < MAX_VEC_TYPES; i++) {
        cpu_free(NULL, c->xq[i]);
        c->xq[i] = NULL;
    }
}

static void drop_packs(cpu_backend *c);

static void cpu_destroy(fitm_backend *b)
{
    cpu_backend *c = cpu(b);
    drop_packs(c);
    free(c->packs);
    release_scratch(c);
    fitm_pool_destroy(c->pool);
    free(c);
}

static void **alloc_per_thread(int n, size_t bytes)
{
    void **v = calloc((size_t)n, sizeof *v);
    if (!v)
        return NULL;
    for (int i = 0; i < n; i++) {
        v[i] = cpu_alloc(NULL, bytes);
        if (!v[i]) {
            free_per_thread(v, n);
            return NULL;
        }
    }
    return v;
}

static fitm_status cpu_reserve(fitm_backend *b, int64_t max_tokens, int64_t max_keys,
                               int64_t max_k, fitm_err *err)
{
    cpu_backend *c = cpu(b);
    if (c->scores && max_tokens <= c->max_tokens && max_keys <= c->max_keys && max_k <= c->max_k)
        return FITM_OK;
    if (max_tokens < c->max_tokens)
        max_tokens = c->max_tokens;
    if (max_keys < c->max_keys)
        max_keys = c->max_keys;
    if (max_k < c->max_k)
        max_k = c->max_k;
    release_scratch(c);
    /* The widest quantized activation row: Q8_K (292 bytes per 256) or Q8_0 (34 per 32). */
    size_t row = fitm_dtype_row_bytes(FITM_DTYPE_Q8_K, (max_k + 255) / 256 * 256);
    size_t row0 = fitm_dtype_row_bytes(FITM_DTYPE_Q8_0, (max_k + 31) / 32 * 32);
    c->xq_row_cap = row > row0 ? row : row0;
    c->scores = (float **)alloc_per_thread(c->n_threads,
                                           (size_t)TILE_Q * (size_t)max_keys * sizeof(float));
    c->mixed = (float **)alloc_per_thread(c->n_threads,
                                          (size_t)TILE_Q * (size_t)max_keys * sizeof(float));
    c->mass = (double **)alloc_per_thread(c->n_threads, FITM_FORWARD_MAX_SPANS * sizeof(double));
    c->mm_scratch = (float **)alloc_per_thread(
        c->n_threads, (size_t)(FLOAT_TILE + PACK_ROWS) * (size_t)max_k * sizeof(float));
    c->zero_row = cpu_alloc(NULL, (size_t)max_k * sizeof(float));
    bool ok = c->scores && c->mixed && c->mass && c->mm_scratch && c->zero_row;
    for (int i = 0; i < MAX_VEC_TYPES && ok; i++) {
        c->xq[i] = cpu_alloc(NULL, c->xq_row_cap * (size_t)max_tokens);
        ok = c->xq[i] != NULL;
    }
    if (!ok) {
        release_scratch(c);
        c->max_tokens = c->max_keys = c->max_k = 0;
        return fitm_err_set(err, FITM_ERR_NOMEM,
                            "CPU backend: cannot allocate scratch for %lld tokens x %lld keys",
                            (long long)max_tokens, (long long)max_keys);
    }
    c->max_tokens = max_tokens;
    c->max_keys = max_keys;
    c->max_k = max_k;
    return FITM_OK;
}

/* ---- row-parallel helpers ---------------------------------------------------------------- */

/* Splits [0, n) into about n_threads equal chunks of whole rows. */
typedef struct {
    int64_t n, per;
    void (*fn)(void *ctx, int64_t i0, int64_t i1);
    void *ctx;
} range_job;

static void range_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    range_job *j = ctx;
    int64_t i0 = task * j->per, i1 = i0 + j->per < j->n ? i0 + j->per : j->n;
    if (i0 < i1)
        j->fn(j->ctx, i0, i1);
}

/* Runs fn over rows [0, n) where each row costs row_elems; inline when small. */
static void par_rows(cpu_backend *c, int64_t n, int64_t row_elems,
                     void (*fn)(void *ctx, int64_t i0, int64_t i1), void *ctx)
{
    if (c->n_threads == 1 || n < 2 || n * row_elems < PAR_MIN_ELEMS) {
        fn(ctx, 0, n);
        return;
    }
    range_job j = {n, (n + c->n_threads - 1) / c->n_threads, fn, ctx};
    fitm_pool_run(c->pool, (n + j.per - 1) / j.per, range_task, &j);
}

/* ---- packed weights ---------------------------------------------------------------------- */

static packed_weight *find_pack(const cpu_backend *c, const fitm_weight *w)
{
    size_t lo = 0, hi = c->n_packs;
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (c->packs[mid].stored == w->data)
            return &c->packs[mid];
        if ((uintptr_t)c->packs[mid].stored < (uintptr_t)w->data)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static const void *packed_of(const cpu_backend *c, const fitm_weight *w)
{
    const packed_weight *pw = find_pack(c, w);
    return pw ? pw->packed : NULL;
}

static int cmp_pack(const void *a, const void *b)
{
    const uintptr_t x = (uintptr_t)((const packed_weight *)a)->stored,
                    y = (uintptr_t)((const packed_weight *)b)->stored;
    return x < y ? -1 : x > y;
}

typedef struct {
    const fitm_weight *w;
    void *packed;
    int64_t groups_per_task;
} pack_job;

static void pack_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    const pack_job *j = ctx;
    const fitm_weight *w = j->w;
    const int64_t n0 = task * j->groups_per_task * FITM_PACK_ROWS,
                  n = j->groups_per_task * FITM_PACK_ROWS < w->n_rows - n0
                          ? j->groups_per_task * FITM_PACK_ROWS
                          : w->n_rows - n0;
    fitm_pack(w->type, (const uint8_t *)w->data + (size_t)n0 * w->row_bytes, n, w->n_cols,
              (uint8_t *)j->packed + fitm_pack_bytes(w->type, n0, w->n_cols)); /* 0 at n0 = 0 */
}

/* Packs w when this path has a faster layout for it, then lets the model drop the stored
 * bytes' pages (every product and row read of w goes to the copy). */
static fitm_status pack_weight(cpu_backend *c, const fitm_model *m, const fitm_weight *w,
                               fitm_err *err)
{
    const size_t bytes = fitm_pack_bytes(w->type, w->n_rows, w->n_cols);
    if (!w->data || w->n_rows <= 1 || !bytes || find_pack(c, w))
        return FITM_OK; /* found: a view of the same data (a tied output head) */
    void *p = cpu_alloc(&c->base, bytes);
    if (!p)
        return fitm_err_set(err, FITM_ERR_NOMEM, "CPU backend: no memory to pack %s", w->name);
    fitm_mem_hugepages(p); /* before the pages are touched: the products stream every byte */
    const int64_t groups = w->n_rows / FITM_PACK_ROWS, per = groups / (8 * c->n_threads) + 1;
    pack_job j = {w, p, per};
    fitm_pool_run(c->pool, (groups + per - 1) / per, pack_task, &j);
    c->packs[c->n_packs++] = (packed_weight){w->data, p};
    qsort(c->packs, c->n_packs, sizeof *c->packs, cmp_pack);
    fitm_model_release(m, w);
    return FITM_OK;
}

static void drop_packs(cpu_backend *c)
{
    for (size_t i = 0; i < c->n_packs; i++)
        cpu_free(&c->base, c->packs[i].packed);
    c->n_packs = 0;
    c->packed_model = NULL;
    c->model_refs = 0;
}

/* One model's packed copies at a time, kept while a forward that prepared them lives: a
 * forward of an earlier model still alive then runs on its stored weights (the same values
 * but for float rounding; the products take the stored layout for any view not packed). */
static fitm_status cpu_prepare(fitm_backend *b, const fitm_model *m, fitm_err *err)
{
    cpu_backend *c = cpu(b);
    if (c->packed_model == m) {
        c->model_refs++;
        return FITM_OK;
    }
    drop_packs(c);
    const int64_t n = fitm_model_n_weights(m);
    packed_weight *pw = realloc(c->packs, (size_t)n * sizeof *pw);
    if (!pw)
        return fitm_err_set(err, FITM_ERR_NOMEM, "CPU backend: weight table");
    c->packs = pw;
    fitm_status s = FITM_OK;
    for (int64_t i = 0; i < n && !s; i++)
        s = pack_weight(c, m, fitm_model_weight_at(m, i), err);
    if (s) {
        drop_packs(c);
        return s;
    }
    c->packed_model = m;
    c->model_refs = 1;
    return FITM_OK;
}

static void cpu_release(fitm_backend *b, const fitm_model *m)
{
    cpu_backend *c = cpu(b);
    if (c->packed_model == m && --c->model_refs == 0)
        drop_packs(c);
}

/* ---- element-wise and row-wise ops ------------------------------------------------------- */

typedef struct {
    const fitm_weight *w;
    const void *packed; /* w's packed copy, or NULL */
    const int32_t *ids;
    float scale;
    float *x;
} embed_job;

static void embed_rows(void *ctx, int64_t i0, int64_t i1)
{
    embed_job *j = ctx;
    const int64_t C = j->w->n_cols;
    for (int64_t t = i0; t < i1; t++) {
        float *xr = j->x + t * C;
        if (j->packed)
            fitm_packed_row(j->w->type, j->packed, C, j->ids[t], xr);
        else
            fitm_dequant_row(j->w->type,
                             (const uint8_t *)j->w->data + (size_t)j->ids[t] * j->w->row_bytes, xr, C);
        if (j->scale != 1.0f)
            for (int64_t i = 0; i < C; i++)
                xr[i] *= j->scale;
    }
}

static void cpu_embed(fitm_backend *b, const fitm_weight *w, const int32_t *ids, int64_t T,
                      float scale, float *x)
{
    embed_job j = {w, packed_of(cpu(b), w), ids, scale, x};
    par_rows(cpu(b), T, w->n_cols, embed_rows, &j);
}

typedef struct {
    float *x;
    int64_t n_heads, D, n_rot;
    const float *cs;
    bool neox;
} rope_job;

static void rope_rows(void *ctx, int64_t t0, int64_t t1)
{
    rope_job *j = ctx;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h = 0; h < j->n_heads; h++)
            fitm_ops_rope_apply(j->x + (t * j->n_heads + h) * j->D, j->cs + t * j->n_rot, j->n_rot,
                                j->neox);
}

static void cpu_rope(fitm_backend *b, float *x, int64_t T, int64_t n_heads, int64_t D,
                     int64_t n_rot, const float *cs, bool neox)
{
    rope_job j = {x, n_heads, D, n_rot, cs, neox};
    par_rows(cpu(b), T, n_heads * n_rot, rope_rows, &j);
}

typedef struct {
    float *y;
    const float *g, *u;
    fitm_act act;
} glu_job;

static void glu_fast(float *y, const float *g, const float *u, int64_t n, fitm_act act);

static void glu_range(void *ctx, int64_t i0, int64_t i1)
{
    glu_job *j = ctx;
    glu_fast(j->y + i0, j->g + i0, j->u + i0, i1 - i0, j->act);
}

static void cpu_glu(fitm_backend *b, float *y, const float *g, const float *u, int64_t n,
                    fitm_act act)
{
    glu_job j = {y, g, u, act};
    par_rows(cpu(b), n, 8, glu_range, &j); /* a GLU element costs about 8 adds */
}

typedef struct {
    float *y;
    const float *x;
} add_job;

static void add_range(void *ctx, int64_t i0, int64_t i1)
{
    add_job *j = ctx;
    for (int64_t i = i0; i < i1; i++)
        j->y[i] += j->x[i];
}

static void cpu_add(fitm_backend *b, float *y, const float *x, int64_t n)
{
    add_job j = {y, x};
    par_rows(cpu(b), n, 1, add_range, &j);
}

static void cpu_softcap(fitm_backend *b, float *x, int64_t n, float cap)
{
    (void)b;
    for (int64_t i = 0; i < n; i++)
        x[i] = cap * tanhf(x[i] / cap);
}

/* ---- fixed-order dot products ------------------------------------------------------------ */

/* Vector width: 16 floats in the avx512 object (full-width FMA units on current x86 cores), 8
 * otherwise. Fixed per object, and the object fixed per process (base/cpu.h), so a binary on
 * one machine always sums the same way; the paths differ from each other in the last bits
 * (16 or 8 lanes; FMA or a rounded multiply then add in the baseline object). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

/* Unaligned vector access through a may_alias type: GCC 12 lowers a 32-byte memcpy into a
 * vector as two 16-byte stores to the stack and one 32-byte reload, a store-forwarding stall
 * on every weight load of the product kernels (measured: 70% of prefill time on AVX2). */
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline vf ldv(const float *p)
{
    return *(const vf_u *)p;
}

static inline void stv(float *p, vf v)
{
    *(vf_u *)p = v;
}

/* acc + a * b, fused where the CPU has FMA. Whichever it is, it is the same everywhere in
 * this file, so results stay independent of blocking. */
static inline vf fmav(vf a, vf b, vf acc)
{
#if VW == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

static inline vf splatv(float x)
{
    return x - (vf){0}; /* scalar op vector broadcasts */
}

/* Whether any lane of a comparison mask is set. */
static inline bool anyv(vi m)
{
#if VW == 16
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif defined(__FMA__)
    return _mm256_movemask_ps((__m256)m) != 0;
#else
    int32_t t[VW];
    memcpy(t, &m, sizeof t);
    for (int i = 0; i < VW; i++)
        if (t[i])
            return true;
    return false;
#endif
}

/* fitm_ops_topk's list of one row: once the list is full (and its last entry is a number),
 * a block of 4 VW values none of which is greater than the list's last entry cannot change it
 * (fitm_ops_topk_add), so it is skipped after one vector comparison; other blocks go through
 * the insertion in order. The same list, at a few vector operations per 64 values instead of
 * a compare and branch per value (a decode step of 8 sequences scans 8 rows of Gemma 3's
 * 262144 logits). */
static void topk_row(const float *x, int64_t n, int32_t k, fitm_top *top)
{
    const int64_t blk = 4 * VW;
    int32_t have = 0;
    int64_t i = n < k ? n : k;
    fitm_ops_topk_add(x, 0, i, k, top, &have);
    for (; have == k && top[k - 1].logit == top[k - 1].logit && i + blk <= n; i += blk) {
        const vf t = splatv(top[k - 1].logit);
        const vi gt = (ldv(x + i) > t) | (ldv(x + i + VW) > t) | (ldv(x + i + 2 * VW) > t) |
                      (ldv(x + i + 3 * VW) > t);
        if (anyv(gt))
            fitm_ops_topk_add(x, i, i + blk, k, top, &have);
    }
    fitm_ops_topk_add(x, i, n, k, top, &have);
}

typedef struct {
    const float *x;
    int64_t n;
    int32_t k;
    fitm_top *top;
} topk_job;

static void topk_task(void *ctx, int64_t r, int thread)
{
    (void)thread;
    const topk_job *j = ctx;
    topk_row(j->x + r * j->n, j->n, j->k, j->top + r * j->k);
}

/* A row per task: a decode step of several sequences scans each one's logits (1 MiB per row
 * on Gemma 3), which one thread alone did while the others waited. */
static void cpu_topk(fitm_backend *b, const float *x, int64_t rows, int64_t n, int32_t k,
                     fitm_top *top)
{
    topk_job j = {x, n, k, top};
    fitm_pool_run(cpu(b)->pool, rows, topk_task, &j);
}

/* e^x for VW floats: x = n ln2 + r (|r| <= ln2/2, ln2 split in two for exactness), e^r by a
 * degree-6 polynomial, 2^n through the exponent bits; about 2 ulp over the range softmax
 * and the activations use. Inputs below -87 give 0, above 88 give +inf. */

/* mask ? a : b, lane by lane (mask lanes are 0 or -1, as vector comparisons give). */
static inline vf selv(vi mask, vf a, vf b)
{
    vi ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    vi r = (mask & ia) | (~mask & ib);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline vf expv(vf x)
{
    x = selv(x < splatv(88.0f), x, splatv(88.0f));
    const vi under = x < splatv(-87.0f);
    x = selv(under, splatv(-87.0f), x);
    vf n = x * splatv(1.44269504088896341f);
    n += selv(n >= splatv(0.0f), splatv(0.5f), splatv(-0.5f));
    n = __builtin_convertvector(__builtin_convertvector(n, vi), vf); /* round half away */
    vf r = fmav(n, splatv(-0.693359375f), x);
    r = fmav(n, splatv(2.12194440e-4f), r);
    vf p = splatv(1.9875691500e-4f);
    p = fmav(p, r, splatv(1.3981999507e-3f));
    p = fmav(p, r, splatv(8.3334519073e-3f));
    p = fmav(p, r, splatv(4.1665795894e-2f));
    p = fmav(p, r, splatv(1.6666665459e-1f));
    p = fmav(p, r, splatv(5.0000001201e-1f));
    p = fmav(p, r * r, r + splatv(1.0f));
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &e, sizeof scale);
    return selv(under, splatv(0.0f), p * scale);
}

static inline float hsumv(vf v)
{
    /* pairwise, in a fixed tree: t[i] + t[i + w] for w = VW/2, ..., 1. The x86 objects add
     * the same pairs as vector halves (lanes [0, w) + lanes [w, 2w)), which are the same
     * sums in registers instead of a chain of scalar adds through memory. */
#if VW == 16
    return fitm_hsum8(_mm256_add_ps(_mm512_castps512_ps256((__m512)v), _mm512_extractf32x8_ps((__m512)v, 1)));
#elif defined(__FMA__)
    return fitm_hsum8((__m256)v);
#else
    float t[VW];
    memcpy(t, &v, sizeof t);
    for (int w = VW / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++)
            t[i] = t[i] + t[i + w];
    return t[0];
#endif
}

/* The activations with expv: gelu_tanh(g) = g / (1 + e^(-2u)), u = sqrt(2/pi)(g + 0.044715 g^3)
 * (the tanh form rewritten), silu(g) = g / (1 + e^(-g)); within ~1e-7 of ops.c's references. */
static void glu_fast(float *y, const float *g, const float *u, int64_t n, fitm_act act)
{
    int64_t i = 0;
    const vf one = splatv(1.0f);
    for (; i + VW <= n; i += VW) {
        vf x = ldv(g + i), z;
        if (act == FITM_ACT_GELU)
            z = splatv(-2.0f * 0.7978845608028654f) * fmav(splatv(0.044715f) * x * x, x, x);
        else
            z = -x;
        stv(y + i, x / (one + expv(z)) * ldv(u + i));
    }
    if (i < n) {
        if (act == FITM_ACT_GELU)
            fitm_ops_geglu(y + i, g + i, u + i, n - i);
        else
            fitm_ops_swiglu(y + i, g + i, u + i, n - i);
    }
}

/* In-place softmax of x (n): max, e^(x - max) with expv, 1/sum; lanes summed in fixed order. */
static void softmax_fast(float *x, int64_t n)
{
    float mx = x[0];
    for (int64_t i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    vf acc = splatv(0.0f);
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf e = expv(ldv(x + i) - splatv(mx));
        stv(x + i, e);
        acc += e;
    }
    float tail = 0.0f;
    for (; i < n; i++) {
        vf e = expv(splatv(x[i] - mx));
        x[i] = e[0];
        tail += e[0];
    }
    const float inv = 1.0f / (hsumv(acc) + tail);
    for (i = 0; i < n; i++)
        x[i] *= inv;
}

/* ---- log-probabilities ----------------------------------------------------------------- */

typedef struct {
    const float *x;
    int64_t n;
    const int32_t *pick;
    int32_t n_pick;
    double *lp;
} logprob_job;

/* fitm_ops_logprob's sum on vectors of its 8 lanes (2 of 4 doubles on AVX2, 1 of 8 on
 * AVX-512, 4 of 2 on the baseline): the same operations on the same values in every lane, so
 * the same bits. */
typedef double vd8 __attribute__((vector_size(64)));
typedef int64_t vl8 __attribute__((vector_size(64)));
typedef uint64_t vu8 __attribute__((vector_size(64)));
typedef float vf8_u __attribute__((vector_size(32), aligned(4), may_alias));
_Static_assert(FITM_LOGPROB_LANES == 8, "one vd8 holds fitm_ops_logprob's lanes");

/* (The vectors go by pointer: a 64-byte vector passed by value has another ABI on AVX-512.) */
#define SPLAT8(x) ((x) - (vd8){0})

/* *e = fitm_ops_exp_le0 of *dp lane by lane (NaN lanes NaN, of another payload perhaps). */
static inline void exp_le0_v(vd8 *e, const vd8 *dp)
{
    const vd8 d = *dp;
    const vl8 in = ~(d < SPLAT8(FITM_EXP_MIN)); /* NaN stays in, and gives NaN */
    const vd8 t = d * FITM_EXP_INV_LN2 + FITM_EXP_SHIFT;
    const vd8 k = t - FITM_EXP_SHIFT;
    const vd8 f = (d - k * FITM_EXP_LN2_HI) - k * FITM_EXP_LN2_LO;
    const vu8 p2 = (vu8)((vl8)t - (vl8)SPLAT8(FITM_EXP_SHIFT) + 1023) << 52; /* 2^k */
    *e = (vd8)((vl8)(FITM_EXP_POLY(f) * (vd8)p2) & in);
}

/* fitm_ops_logprob of one row, its bits. The maximum by vectors is the scan's value; only a
 * zero maximum's sign may differ (the scan keeps the first zero, the lanes their own), which
 * changes no output: x - mx is then a zero whose e^ is 1 either way, or x itself, and a
 * picked zero's lp = 0 - log z with z > 1 when several zeros tie (z = 1: a single zero, the
 * maximum of both). Then the lane sums by vectors. A NaN lane (a NaN value, or inf - inf)
 * comes out as d itself, as fitm_ops_exp_le0 returns it: each operation on it returns its NaN
 * operand (2^k's bits are never a NaN), and the adds meet the NaNs in the scalar path's order
 * (test_backend_ops: rows with a NaN, a +inf, signed zeros, all -inf). */
static void logprob_row(const float *x, int64_t n, const int32_t *pick, int32_t n_pick,
                        double *lp)
{
    int64_t v = 0;
    float mx = x[0];
    if (n >= VW) {
        vf lane_max = splatv(x[0]);
        for (; v + VW <= n; v += VW) {
            const vf y = ldv(x + v);
            lane_max = selv(y > lane_max, y, lane_max);
        }
        float m[VW];
        memcpy(m, &lane_max, sizeof m);
        for (int i = 0; i < VW; i++)
            mx = m[i] > mx ? m[i] : mx;
    }
    for (; v < n; v++)
        mx = x[v] > mx ? x[v] : mx;
    vd8 acc = SPLAT8(0.0);
    const vd8 mxv = SPLAT8((double)mx);
    for (v = 0; v + 8 <= n; v += 8) {
        const vd8 d = __builtin_convertvector(*(const vf8_u *)(x + v), vd8) - mxv;
        vd8 e;
        exp_le0_v(&e, &d);
        acc += e;
    }
    double l[8];
    memcpy(l, &acc, sizeof l);
    for (; v < n; v++)
        l[v % 8] += fitm_ops_exp_le0((double)x[v] - (double)mx);
    fitm_ops_logprob_lanes(l, mx, x, pick, n_pick, lp);
}

static void logprob_task(void *ctx, int64_t r, int thread)
{
    (void)thread;
    const logprob_job *j = ctx;
    logprob_row(j->x + r * j->n, j->n, j->pick + r * j->n_pick, j->n_pick,
                j->lp + r * j->n_pick);
}

/* A row per task, each row by one thread: fitm_ops_logprob's values bit for bit, the rows of
 * a scored pass (a query-likelihood chunk: up to 32) over the threads. */
static void cpu_logprob(fitm_backend *b, const float *x, int64_t rows, int64_t n,
                        const int32_t *pick, int32_t n_pick, double *lp)
{
    logprob_job j = {x, n, pick, n_pick, lp};
    fitm_pool_run(cpu(b)->pool, rows, logprob_task, &j);
}

/* ---- RMS norm -------------------------------------------------------------------------- */

typedef struct {
    float *y;
    const float *x;
    const float *w;
    int64_t n;
    float eps;
} norm_job;

/* fitm_ops_rmsnorm (w_offset 0) on vectors, its bits: the 16 lanes of the sum of squares as two
 * vectors of 8 doubles, the same multiply and add in each lane, and the output's two products
 * in the same order. */
_Static_assert(FITM_NORM_LANES == 16, "two vd8 hold fitm_ops_rmsnorm's lanes");

static void rmsnorm_row(float *y, const float *x, const float *w, int64_t C, float eps)
{
    vd8 a[2] = {{0}};
    for (int64_t c = 0; c + 16 <= C; c += 16)
        for (int h = 0; h < 2; h++) {
            const vd8 d = __builtin_convertvector(*(const vf8_u *)(x + c + 8 * h), vd8);
            a[h] += d * d;
        }
    double lanes[16];
    memcpy(lanes, a, sizeof lanes);
    const float scale = fitm_ops_rmsnorm_scale(lanes, x, C, eps);
    const vf s = splatv(scale);
    int64_t c = 0;
    for (; c + VW <= C; c += VW) /* w + 0 as fitm_ops_rmsnorm's w + w_offset: -0 becomes +0 */
        stv(y + c, ldv(x + c) * s * (ldv(w + c) + 0.0f));
    for (; c < C; c++)
        y[c] = x[c] * scale * (w[c] + 0.0f);
}

static void norm_rows(void *ctx, int64_t i0, int64_t i1)
{
    norm_job *j = ctx;
    for (int64_t i = i0; i < i1; i++)
        rmsnorm_row(j->y + i * j->n, j->x + i * j->n, j->w, j->n, j->eps);
}

static void cpu_rmsnorm(fitm_backend *b, float *y, const float *x, const fitm_weight *w,
                        int64_t rows, int64_t n, float eps)
{
    norm_job j = {y, x, w->data, n, eps};
    par_rows(cpu(b), rows, n, norm_rows, &j);
}

/* ---- matrix products --------------------------------------------------------------------- */

/* Which path a product takes. Each output element is summed in an order that depends only on
 * the path, never on T or on the row's place in the batch, so two calls on the same path give
 * bit-identical rows however a sequence was split (prefix reuse and the calibration's
 * reference passes rely on that; BLAS sgemm does not promise it, and OpenBLAS does change
 * kernels with M). Float weights (F32, F16, BF16) always take the float path: tiles converted
 * to F32 and multiplied by mm_float_tile's fixed-order kernel. Quantized weights take it too
 * when the caller says the call is batched (the tile's conversion is then shared by many
 * rows); otherwise the quantized dot product, with activations quantized to the weight's
 * partner type (Q8_0 / Q8_K) as llama.cpp does, which is what a decode step can afford. */
static bool is_float_type(fitm_dtype t)
{
    return t == FITM_DTYPE_F32 || t == FITM_DTYPE_F16 || t == FITM_DTYPE_BF16;
}

/* Float-path product of one weight tile: Y[m, n] = X[m, :] . W[n, :] for m in [0, T) and n in
 * [n0, n1), n1 - n0 <= FLOAT_TILE. The tile is converted to F32 and packed K-major
 * (Wp[k][r], FLOAT_TILE wide, zero-padded), then a register-blocked kernel multiplies MR rows
 * of X by NB vectors of columns at a time: every Y element is one vector lane accumulated by
 * fused multiply-adds over k = 0, 1, ..., K-1 in order, so the blocking, T and the row's place
 * in the batch never change its value. */
#if VW == 16
#define MR 6 /* 6 x 4 accumulators + 4 weight vectors + 1 broadcast of 32 registers */
#define NB 4
#else
#define MR 6 /* 6 x 2 accumulators + 2 weight vectors + 1 broadcast of 16 registers */
#define NB 2
#endif

_Static_assert(FITM_PACK_ROWS % PACK_ROWS == 0 && FLOAT_TILE % FITM_PACK_ROWS == 0,
               "a float tile holds whole packed groups, converted in steps of PACK_ROWS");

/* The tile's converted rows [0, nr) of a packed weight, K-major into Wp: its tiles start at
 * multiples of FLOAT_TILE and its N is a multiple of 16, so they are whole groups, whose 16
 * rows a chunk already holds side by side (fitm_packed_cols). */
static void packed_tile(const fitm_weight *w, const void *packed, int64_t n0, int64_t nr,
                        float *Wp)
{
    assert(n0 % FITM_PACK_ROWS == 0 && nr % FITM_PACK_ROWS == 0);
    for (int64_t r0 = 0; r0 < nr; r0 += FITM_PACK_ROWS)
        fitm_packed_cols(w->type, packed, w->n_cols, n0 + r0, Wp + r0, FLOAT_TILE);
}

static void mm_float_tile(const fitm_weight *w, const void *packed, const float *X, int64_t T,
                          float *Y, int64_t n0, int64_t n1, float *scratch, const float *zero_row)
{
    const int64_t K = w->n_cols, N = w->n_rows, nr = n1 - n0;
    float *Wp = scratch;                   /* (K, FLOAT_TILE) */
    float *rows = scratch + K * FLOAT_TILE; /* (PACK_ROWS, K) converted rows */
    if (packed)
        packed_tile(w, packed, n0, nr, Wp);
    for (int64_t r0 = packed ? nr : 0; r0 < FLOAT_TILE; r0 += PACK_ROWS) {
        /* PACK_ROWS rows converted (of a packed weight, only the zero rows past nr), then
         * written column by column: each k stores PACK_ROWS adjacent floats of Wp instead of
         * one float per cache line of the tile */
        const float *src[PACK_ROWS];
        for (int i = 0; i < PACK_ROWS; i++) {
            const int64_t r = r0 + i;
            if (r >= nr) {
                src[i] = zero_row;
            } else if (w->type == FITM_DTYPE_F32) {
                src[i] = (const float *)w->data + (n0 + r) * K;
            } else {
                fitm_dequant_row(w->type,
                                 (const uint8_t *)w->data + (size_t)(n0 + r) * w->row_bytes,
                                 rows + i * K, K);
                src[i] = rows + i * K;
            }
        }
        for (int64_t k = 0; k < K; k++)
            for (int i = 0; i < PACK_ROWS; i++)
                Wp[k * FLOAT_TILE + r0 + i] = src[i][k];
    }
    for (int64_t c0 = 0; c0 < nr; c0 += NB * VW) {
        for (int64_t m0 = 0; m0 < T; m0 += MR) {
            const float *x[MR];
            for (int i = 0; i < MR; i++)
                x[i] = m0 + i < T ? X + (m0 + i) * K : zero_row;
            vf acc[MR][NB];
            for (int i = 0; i < MR; i++)
                for (int c = 0; c < NB; c++)
                    acc[i][c] = splatv(0.0f);
            const float *wp = Wp + c0;
            for (int64_t k = 0; k < K; k++, wp += FLOAT_TILE) {
                vf wv[NB];
                for (int c = 0; c < NB; c++)
                    wv[c] = ldv(wp + c * VW);
                for (int i = 0; i < MR; i++) {
                    const vf a = splatv(x[i][k]);
                    for (int c = 0; c < NB; c++)
                        acc[i][c] = fmav(a, wv[c], acc[i][c]);
                }
            }
            for (int i = 0; i < MR && m0 + i < T; i++) {
                float out[NB * VW];
                for (int c = 0; c < NB; c++)
                    stv(out + c * VW, acc[i][c]);
                int64_t n_valid = nr - c0 < NB * VW ? nr - c0 : NB * VW;
                memcpy(Y + (m0 + i) * N + n0 + c0, out, (size_t)n_valid * sizeof(float));
            }
        }
    }
}

typedef struct {
    const fitm_mm_out *o;
    const void *packed;  /* the weight's packed copy, or NULL                          */
    const uint8_t *xq;   /* quantized activations for this output, or NULL (BLAS path) */
    size_t xq_row;
    int64_t rows_per_task;
    int64_t first_task;
} mm_part;

typedef struct {
    cpu_backend *c;
    const float *x;
    int64_t T;
    mm_part parts[8];
    int n_parts;
} mm_job;

static void add_bias(const fitm_mm_out *o, int64_t T, int64_t n0, int64_t n1)
{
    if (!o->bias)
        return;
    const float *bias = o->bias->data;
    const int64_t N = o->w->n_rows;
    for (int64_t m = 0; m < T; m++)
        for (int64_t n = n0; n < n1; n++)
            o->y[m * N + n] += bias[n];
}

static void mm_task(void *ctx, int64_t task, int thread)
{
    mm_job *j = ctx;
    int p = j->n_parts - 1;
    while (task < j->parts[p].first_task)
        p--;
    const mm_part *pt = &j->parts[p];
    const fitm_weight *w = pt->o->w;
    const int64_t N = w->n_rows, K = w->n_cols;
    int64_t n0 = (task - pt->first_task) * pt->rows_per_task;
    int64_t n1 = n0 + pt->rows_per_task < N ? n0 + pt->rows_per_task : N;
    float *y = pt->o->y;
    if (pt->xq && pt->packed) {
        fitm_matvec_rows_packed(w->type, pt->packed, K, pt->xq, pt->xq_row, j->T, y, N, n0, n1);
    } else if (pt->xq) {
        fitm_matvec_rows(w->type, w->data, K, pt->xq, pt->xq_row, j->T, y, N, n0, n1);
    } else {
        for (int64_t t0 = n0; t0 < n1; t0 += FLOAT_TILE)
            mm_float_tile(w, pt->packed, j->x, j->T, y, t0,
                          t0 + FLOAT_TILE < n1 ? t0 + FLOAT_TILE : n1, j->c->mm_scratch[thread],
                          j->c->zero_row);
    }
    add_bias(pt->o, j->T, n0, n1);
}

typedef struct {
    const float *x;
    int64_t K;
    fitm_dtype vt;
    uint8_t *xq;
    size_t row;
} quant_job;

static void quant_rows(void *ctx, int64_t i0, int64_t i1)
{
    quant_job *j = ctx;
    for (int64_t m = i0; m < i1; m++)
        fitm_quant_row(j->vt, j->x + m * j->K, j->xq + (size_t)m * j->row, j->K);
}

static void cpu_matmul(fitm_backend *b, const float *x, int64_t T, const fitm_mm_out *outs,
                       int n_outs, bool batched)
{
    cpu_backend *c = cpu(b);
    mm_job j = {.c = c, .x = x, .T = T};
    fitm_dtype done_vt[MAX_VEC_TYPES];
    int n_vt = 0;
    int64_t n_tasks = 0;
    assert(n_outs <= 8);
    for (int i = 0; i < n_outs; i++) {
        const fitm_weight *w = outs[i].w;
        const int64_t N = w->n_rows, K = w->n_cols;
        mm_part *pt = &j.parts[j.n_parts++];
        pt->o = &outs[i];
        pt->packed = packed_of(c, w);
        pt->xq = NULL;
        if (!is_float_type(w->type) && !batched) {
            fitm_dtype vt = fitm_quant_vec_dtype(w->type);
            int v = 0;
            while (v < n_vt && done_vt[v] != vt)
                v++;
            pt->xq_row = fitm_dtype_row_bytes(vt, K);
            if (v == n_vt) { /* first output needing this activation type: quantize x once */
                done_vt[n_vt++] = vt;
                quant_job q = {x, K, vt, c->xq[v], pt->xq_row};
                par_rows(c, T, K * 4, quant_rows, &q);
            }
            pt->xq = c->xq[v];
            /* When the T rows need more than one read of the weights, keep a task's weight
             * rows in L1/L2 while all T rows pass over them. When one read serves them all
             * (one row, or the few of a decode step: fitm_matvec_rows_once), enough tasks per
             * thread that a thread the OS delays does not hold up the others for long, but
             * about MATVEC_TASK_BYTES of weights per task: shorter streams from DRAM run
             * well below the memory bandwidth. The tasks of one weight are of equal size, as
             * many as a multiple of the threads: with the rows of 8 sequences a task is long,
             * and one left over would idle a thread. (Measurements: docs/cpu-forward-
             * benchmark.md, "Task sizes of a product that reads its weights once" and the
             * fourteenth session.) */
            int64_t rpt = (int64_t)(16384 / w->row_bytes);
            if (pt->packed || T <= fitm_matvec_rows_once(w->type, K)) {
                const int64_t nt = c->n_threads;
                int64_t k = (int64_t)(((size_t)N * w->row_bytes + MATVEC_TASK_BYTES - 1) /
                                      MATVEC_TASK_BYTES);
                k = k < 16 * nt ? k : 16 * nt;
                k = (k + nt - 1) / nt * nt;
                rpt = (N + k - 1) / k;
                if (pt->packed) /* whole groups of FITM_PACK_ROWS */
                    rpt = (rpt + FITM_PACK_ROWS - 1) / FITM_PACK_ROWS * FITM_PACK_ROWS;
            }
            pt->rows_per_task = rpt < 16 ? 16 : rpt;
        } else {
            /* One tile per task: the tile's conversion is the unit of work anyway, and small
             * tasks balance threads the OS delays. */
            pt->rows_per_task = FLOAT_TILE;
        }
        if (pt->rows_per_task > N)
            pt->rows_per_task = N;
        pt->first_task = n_tasks;
        n_tasks += (N + pt->rows_per_task - 1) / pt->rows_per_task;
    }
    fitm_pool_run(c->pool, n_tasks, mm_task, &j);
}

/* ---- attention --------------------------------------------------------------------------- */

/* Attention's two products (scores = Q.K^T, out = P.V) are computed here rather than with
 * sgemm so that every element is summed in one fixed order whatever the shape of the call:
 * BLAS picks kernels by matrix size (M = 1 for a decode step), which changes the rounding of
 * a row depending on how the sequence was split, and with quantized weights one flipped
 * rounding of a Q8 activation is enough to make a reference pass differ visibly from the full
 * pass it is compared with. Here:
 *   score(i, j) = hsum(per-lane partial sums over d in steps of VW) + scalar tail, and
 *   out(i, d)   = sum over keys j in increasing order of p(i, j) * v(j, d) (zeros included),
 * each independent of blocking. Vectors are GCC/Clang vector extensions (VW floats). */
typedef struct {
    cpu_backend *c;
    const fitm_attn_args *a;
    int64_t n_tiles;
    int64_t heads_per_task; /* > 1: one tile of all T rows, that many heads of one group */
} attn_job;

/* One query row of a task: its query vector, its score (then probability) row over the
 * task's keys, and its output vector. A task's rows may come from several heads of one KV
 * group, which then share every K and V row read. */
typedef struct {
    const float *q;
    float *s;
    float *o;
} attn_row;

/* The rows of head h for queries [i0, i0 + nq): queries from q, scores S (nq, nk). */
static void head_rows(const fitm_attn_args *a, const float *q, int64_t h, int64_t i0, int64_t nq,
                      float *S, int64_t nk, attn_row *rows)
{
    const int64_t D = a->head_dim, HD = (int64_t)a->n_head * D;
    for (int64_t i = 0; i < nq; i++)
        rows[i] = (attn_row){q + (i0 + i) * HD + h * D, S + i * nk, a->out + (i0 + i) * HD + h * D};
}

/* The K (or V) row of key position j: in the prefix arrays below own_base, else in the own;
 * at head group g. Its values are F32, or fp16 where half (a->kv_half, a constant in every
 * caller; ldkv reads either). */
static inline const void *kv_row(const fitm_attn_args *a, const void *pre, const void *own,
                                 int64_t j, int64_t g, const bool half)
{
    const int64_t HkvD = (int64_t)a->n_head_kv * a->head_dim;
    const size_t e = half ? sizeof(uint16_t) : sizeof(float);
    const unsigned char *base = j < a->own_base ? pre : own;
    const int64_t row = j < a->own_base ? j : j - a->own_base;
    return base + (size_t)(row * HkvD + g * a->head_dim) * e;
}

/* capture->add: adds row p's keys [lo, lo + n) to slot's span masses and probabilities (the
 * keys outside the row hold 0, and adding 0 leaves the sum as it is). The masses are summed
 * as fitm_ops_span_mass sums them, so one pass added onto zeros stores exactly its masses. */
static void capture_row_add(const fitm_capture *cap, int64_t slot, int64_t pos, const float *p,
                            int64_t lo, int64_t n)
{
    (void)pos;
    if (cap->span_mass && cap->n_spans > 0) {
        float mass[FITM_FORWARD_MAX_SPANS];
        fitm_ops_span_mass(mass, p, lo, n, cap->spans, cap->n_spans);
        float *dst = cap->span_mass + slot * cap->n_spans;
        for (int32_t k = 0; k < cap->n_spans; k++)
            dst[k] += mass[k];
    }
    if (cap->probs) {
        float *dst = cap->probs + slot * cap->probs_stride + lo;
        for (int64_t j = 0; j < n; j++)
            dst[j] += p[j];
    }
}

/* Stores row p's probabilities (keys [lo, lo + nk) of the tile, zero after the row itself)
 * for capture slot r: keys [0, pos] of it, zeros up to probs_stride (>= pos + 1). */
static void capture_row(const fitm_attn_args *a, int64_t h, int32_t r, int64_t pos,
                        const float *p, int64_t lo, int64_t nk)
{
    const fitm_capture *cap = a->capture;
    const int64_t slot = ((int64_t)r * a->n_layer + a->layer) * a->n_head + h;
    const int64_t n = pos + 1 - lo; /* keys [lo, pos] */
    if (cap->add) {
        capture_row_add(cap, slot, pos, p, lo, n < nk ? n : nk);
        return;
    }
    if (cap->span_mass && cap->n_spans > 0)
        fitm_ops_span_mass(cap->span_mass + slot * cap->n_spans, p, lo, n < nk ? n : nk,
                           cap->spans, cap->n_spans);
    if (cap->probs) {
        float *dst = cap->probs + slot * cap->probs_stride;
        memset(dst, 0, (size_t)lo * sizeof(float));
        memcpy(dst + lo, p, (size_t)n * sizeof(float));
        memset(dst + pos + 1, 0, (size_t)(cap->probs_stride - pos - 1) * sizeof(float));
    }
}

#define KERNEL_INLINE static inline __attribute__((always_inline))

/* Value i of a K/V row p, and the VW values from i: F32, or fp16 converted exactly (half is
 * a constant in every caller, so each kernel below is compiled once per value type; a row's
 * dots and sums are the same code on the converted values). */
KERNEL_INLINE float ldkv1(const void *p, int64_t i, const bool half)
{
    return half ? fitm_fp16_to_fp32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

KERNEL_INLINE vf ldkv(const void *p, int64_t i, const bool half)
{
    if (!half)
        return ldv((const float *)p + i);
    const uint16_t *h = (const uint16_t *)p + i;
#if VW == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    float t[VW];
    for (int k = 0; k < VW; k++)
        t[k] = fitm_fp16_to_fp32(h[k]);
    return ldv(t);
#endif
}

/* dot(a, k) over n in the fixed order described above (lanes of VW, then the tail). */
KERNEL_INLINE float dot_fixed(const float *a, const void *k, int64_t n, const bool half)
{
    vf acc = {0};
    int64_t d = 0;
    for (; d + VW <= n; d += VW)
        acc = fmav(ldv(a + d), ldkv(k, d, half), acc);
    float tail = 0.0f;
    for (; d < n; d++)
        tail += a[d] * ldkv1(k, d, half);
    return hsumv(acc) + tail;
}

#if VW == 16
/* hsumv of 16 vectors at once: lane 4r + t = hsumv(acc[r][t]). Each level of hsumv's tree
 * (lane i + lane i + w for w = 8, 4, 2, 1) adds the halves of two vectors in one instruction,
 * the two vectors' halves moved side by side first: 45 operations for the 16 sums instead of
 * 8 each, and the same pairs added, so the same bits. Below, v[4r + t] is acc[r][t]; lane
 * 4t + r ends with v[4r + t]'s sum, and one permutation puts it at 4r + t. */
static inline __m512 hsum16(const vf acc[4][4])
{
    __m512 h8[8], h4[4], h2[2]; /* after the levels w = 8, 4, 2 */
    for (int p = 0; p < 8; p++) { /* w = 8: h8[p] = v[2p]'s 8 sums, then v[2p + 1]'s */
        const __m512 a = (__m512)acc[p / 2][2 * (p % 2)], b = (__m512)acc[p / 2][2 * (p % 2) + 1];
        h8[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int p = 0; p < 4; p++) { /* w = 4: 128-bit part c of h4[p] holds v[4p + c]'s 4 sums */
        const __m512 a = h8[2 * p], b = h8[2 * p + 1];
        h4[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    for (int p = 0; p < 2; p++) { /* w = 2: part c of h2[p]: v[8p + c]'s 2 sums, v[8p + 4 + c]'s */
        const __m512d a = _mm512_castps_pd(h4[2 * p]), b = _mm512_castps_pd(h4[2 * p + 1]);
        h2[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* w = 1: lane 4c + m holds v[4m + c]'s sum */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(h2[0], h2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(h2[0], h2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7,
                                                   11, 15),
                                 s);
}
#endif

/* The same dots for 4 queries x 4 keys at once (each result bit-identical to dot_fixed). */
KERNEL_INLINE void dot_4x4(const float *const q[4], const void *const k[4], int64_t n,
                           float out[4][4], const bool half)
{
    vf acc[4][4] = {{{0}}};
    int64_t d = 0;
    for (; d + VW <= n; d += VW) {
        vf kv[4] = {ldkv(k[0], d, half), ldkv(k[1], d, half), ldkv(k[2], d, half),
                    ldkv(k[3], d, half)};
        for (int i = 0; i < 4; i++) {
            vf qv = ldv(q[i] + d);
            for (int j = 0; j < 4; j++)
                acc[i][j] = fmav(qv, kv[j], acc[i][j]);
        }
    }
    float tail[4][4] = {{0}};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            for (int64_t e = d; e < n; e++)
                tail[i][j] += q[i][e] * ldkv1(k[j], e, half);
#if VW == 16
    _mm512_storeu_ps(out, _mm512_add_ps(hsum16(acc), _mm512_loadu_ps(tail)));
#else
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            out[i][j] = hsumv(acc[i][j]) + tail[i][j];
#endif
}

/* Asks for the lines of key j's K (or V) row at group g, which the kernels read later: a
 * decode step's attention streams each sequence's cache from memory once, and with the
 * hardware prefetchers alone the loads wait. The score kernel asks for K and V rows KV_AHEAD
 * keys ahead, K into L1 for its own dots, V into L2 for the products with the probabilities
 * that follow (8 sequences x 540 fp16 keys x 18 layers, 2 threads: K ahead about a quarter
 * less time, distances 4 and 8 alike, 16 or 32 less gain; V besides, a fifth less again;
 * docs/cpu-forward-benchmark.md). */
#define KV_AHEAD 8

KERNEL_INLINE void prefetch_kv(const fitm_attn_args *a, const void *pre, const void *own,
                               int64_t j, int64_t g, const bool half, const bool to_l2)
{
    const char *p = kv_row(a, pre, own, j, g, half);
    const size_t bytes = (size_t)a->head_dim * (half ? 2 : 4);
    for (size_t o = 0; o < bytes; o += 64) {
        if (to_l2)
            __builtin_prefetch(p + o, 0, 2);
        else
            __builtin_prefetch(p + o, 0, 3);
    }
}

/* rows[r].s[j] = scale * rows[r].q . K[lo + j] for the n rows (all of group g), j < nk. */
KERNEL_INLINE void scores_rows(const fitm_attn_args *a, const attn_row *rows, int64_t n, int64_t g,
                               int64_t lo, int64_t nk, const bool half)
{
    const int64_t D = a->head_dim;
    const bool has_v = a->v_pre || a->v_own; /* not for the mixture's scores */
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *q[4] = {rows[i].q, rows[i + 1].q, rows[i + 2].q, rows[i + 3].q};
        int64_t j = 0;
        for (; j + 4 <= nk; j += 4) {
            const void *k[4];
            for (int t = 0; t < 4; t++)
                k[t] = kv_row(a, a->k_pre, a->k_own, lo + j + t, g, half);
            for (int t = 0; t < 4 && j + KV_AHEAD + t < nk; t++) {
                prefetch_kv(a, a->k_pre, a->k_own, lo + j + KV_AHEAD + t, g, half, false);
                if (has_v)
                    prefetch_kv(a, a->v_pre, a->v_own, lo + j + KV_AHEAD + t, g, half, true);
            }
            float o[4][4];
            dot_4x4(q, k, D, o, half);
            for (int r = 0; r < 4; r++)
                for (int t = 0; t < 4; t++)
                    rows[i + r].s[j + t] = o[r][t] * a->scale;
        }
        for (; j < nk; j++) {
            const void *k = kv_row(a, a->k_pre, a->k_own, lo + j, g, half);
            for (int r = 0; r < 4; r++)
                rows[i + r].s[j] = dot_fixed(q[r], k, D, half) * a->scale;
        }
    }
    if (i < n) /* the last 1-3 rows key by key: each K row is read once for all of them */
        for (int64_t j = 0; j < nk; j++) {
            const void *k = kv_row(a, a->k_pre, a->k_own, lo + j, g, half);
            for (int64_t r = i; r < n; r++)
                rows[r].s[j] = dot_fixed(rows[r].q, k, D, half) * a->scale;
        }
}

static void attn_scores(const fitm_attn_args *a, const attn_row *rows, int64_t n, int64_t g,
                        int64_t lo, int64_t nk)
{
    if (a->kv_half)
        scores_rows(a, rows, n, g, lo, nk, true);
    else
        scores_rows(a, rows, n, g, lo, nk, false);
}

/* rows[0..nr).o[d, d + nv VW) = sum over j < nk, in order, of rows[r].s[j] * V[lo + j][d..];
 * nr (and nv, but for a head dim's last few vectors) are constants after inlining, so the
 * accumulators stay in registers. */
KERNEL_INLINE void pv_block(const fitm_attn_args *a, const attn_row *rows, const int nr, int64_t g,
                            int64_t lo, int64_t nk, int64_t d, const int nv, const bool half)
{
    vf acc[4][4] = {{{0}}};
    for (int64_t j = 0; j < nk; j++) {
        const void *v = kv_row(a, a->v_pre, a->v_own, lo + j, g, half);
        for (int c = 0; c < nv; c++) {
            const vf vv = ldkv(v, d + VW * c, half);
            for (int r = 0; r < nr; r++)
                acc[r][c] = fmav(splatv(rows[r].s[j]), vv, acc[r][c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nv; c++)
            stv(rows[r].o + d + VW * c, acc[r][c]);
}

/* pv_block for nr = 1..4 rows (each count its own constant copy). */
KERNEL_INLINE void pv_rows(const fitm_attn_args *a, const attn_row *rows, int64_t nr, int64_t g,
                           int64_t lo, int64_t nk, int64_t d, const int nv, const bool half)
{
    switch (nr) {
    case 1: pv_block(a, rows, 1, g, lo, nk, d, nv, half); break;
    case 2: pv_block(a, rows, 2, g, lo, nk, d, nv, half); break;
    case 3: pv_block(a, rows, 3, g, lo, nk, d, nv, half); break;
    default: pv_block(a, rows, 4, g, lo, nk, d, nv, half); break;
    }
}

/* rows[r].o = rows[r].s . V[lo, lo + nk) for the n rows (all of group g): up to 4 rows at a
 * time share each V row read. */
KERNEL_INLINE void pv_all(const fitm_attn_args *a, const attn_row *rows, int64_t n, int64_t g,
                          int64_t lo, int64_t nk, const bool half)
{
    const int64_t D = a->head_dim;
    const int64_t D8 = D / VW * VW;
    for (int64_t i = 0; i < n; i += 4) {
        const int64_t nr = n - i < 4 ? n - i : 4;
        for (int64_t d = 0; d < D8; d += 4 * VW) {
            const int nv = (int)((D8 - d) / VW < 4 ? (D8 - d) / VW : 4);
            if (nv == 4) /* every block of a head dim that is a multiple of 4 VW */
                pv_rows(a, rows + i, nr, g, lo, nk, d, 4, half);
            else
                pv_rows(a, rows + i, nr, g, lo, nk, d, nv, half);
        }
    }
    if (D8 < D) /* scalar tail of the head dim, same order */
        for (int64_t r = 0; r < n; r++)
            for (int64_t d = D8; d < D; d++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < nk; j++) {
                    const void *v = kv_row(a, a->v_pre, a->v_own, lo + j, g, half);
                    acc += rows[r].s[j] * ldkv1(v, d, half);
                }
                rows[r].o[d] = acc;
            }
}

static void attn_pv(const fitm_attn_args *a, const attn_row *rows, int64_t n, int64_t g, int64_t lo,
                    int64_t nk)
{
    if (a->kv_half)
        pv_all(a, rows, n, g, lo, nk, true);
    else
        pv_all(a, rows, n, g, lo, nk, false);
}

/* Row i of the tile (position pos0 + i0 + i) becomes softmax over its visible keys [v0, p],
 * exact zeros elsewhere, for each of the nq rows of S (nq, nk). */
static void attn_softmax_rows(const fitm_attn_args *a, int64_t i0, int64_t nq, int64_t lo,
                              int64_t nk, float *S)
{
    for (int64_t i = 0; i < nq; i++) {
        const int64_t p = a->pos0 + i0 + i;
        float *row = S + i * nk;
        int64_t v0 = a->window > 0 && p - a->window + 1 > lo ? p - a->window + 1 : lo;
        softmax_fast(row + (v0 - lo), p - v0 + 1);
        for (int64_t k = lo; k < v0; k++)
            row[k - lo] = 0.0f;
        for (int64_t k = p + 1; k < lo + nk; k++)
            row[k - lo] = 0.0f;
    }
}

/* A (nq, nk) of a mixture for head h: sum over experts of w * softmax(q_e . k_e), each expert
 * in the plain kernels' fixed order, only on the rows whose weight for it is not 0;
 * A starts at exact zeros, so one expert of weight 1 gives its probabilities bit for bit. */
static void attn_mix_probs(const fitm_attn_args *a, int64_t i0, int64_t nq, int64_t h,
                           int64_t lo, int64_t nk, float *S, float *A)
{
    const fitm_attn_mix *mx = a->mix;
    const int64_t H = a->n_head, D = a->head_dim, E = mx->n_mix;
    memset(A, 0, (size_t)(nq * nk) * sizeof(float));
    for (int64_t e = 0; e < E; e++) {
        int64_t used = 0;
        for (int64_t i = 0; i < nq; i++)
            used += mx->w[((i0 + i) * H + h) * E + e] != 0.0f;
        if (!used)
            continue;
        fitm_attn_args ae = *a;
        const float *k = mx->k + e * mx->k_stride;
        const int64_t g = h / (H / mx->k_heads);
        ae.q = mx->q + e * a->T * H * D;
        ae.n_head_kv = mx->k_heads;
        ae.kv_half = false; /* the mixture's keys are F32 (only the scores read ae's keys) */
        ae.k_pre = k; /* kv_row: position j at row j whichever side of own_base */
        ae.k_own = k + a->own_base * mx->k_heads * D;
        ae.v_pre = ae.v_own = NULL; /* only scores here: no V to ask for ahead */
        attn_row rows[TILE_Q];
        if (used == nq) { /* every row: the blocked kernels */
            head_rows(&ae, ae.q, h, i0, nq, S, nk, rows);
            attn_scores(&ae, rows, nq, g, lo, nk);
            attn_softmax_rows(a, i0, nq, lo, nk, S);
        } else { /* only the rows routed here (one-row dots are bit-identical to blocked) */
            for (int64_t i = 0; i < nq; i++)
                if (mx->w[((i0 + i) * H + h) * E + e] != 0.0f) {
                    head_rows(&ae, ae.q, h, i0 + i, 1, S + i * nk, nk, rows);
                    attn_scores(&ae, rows, 1, g, lo, nk);
                    attn_softmax_rows(a, i0 + i, 1, lo, nk, S + i * nk);
                }
        }
        for (int64_t i = 0; i < nq; i++) {
            const float w = mx->w[((i0 + i) * H + h) * E + e];
            if (w == 0.0f)
                continue;
            float *dst = A + i * nk;
            const float *src = S + i * nk;
            for (int64_t j = 0; j < nk; j++)
                dst[j] += w * src[j];
        }
    }
}

static void attn_task(void *ctx, int64_t task, int thread)
{
    attn_job *j = ctx;
    const fitm_attn_args *a = j->a;
    const int64_t H = a->n_head;
    int64_t h0, h1, i0, i1;
    if (j->heads_per_task > 1) {
        h0 = task * j->heads_per_task, h1 = h0 + j->heads_per_task, i0 = 0, i1 = a->T;
    } else {
        const int64_t tile = task % j->n_tiles;
        h0 = task / j->n_tiles, h1 = h0 + 1, i0 = tile * TILE_Q;
        i1 = i0 + TILE_Q < a->T ? i0 + TILE_Q : a->T;
    }
    const int64_t g = h0 / (H / a->n_head_kv); /* the same for every head of the task */
    const int64_t nq = i1 - i0;
    const int64_t p_first = a->pos0 + i0, p_last = a->pos0 + i1 - 1;
    int64_t lo = 0;
    if (a->window > 0 && p_first - a->window + 1 > 0)
        lo = p_first - a->window + 1;
    const int64_t nk = p_last + 1 - lo;
    float *S = j->c->scores[thread]; /* (heads of the task x nq, nk), head by head */
    attn_row rows[TILE_Q] = {{0}};
    const int64_t n = (h1 - h0) * nq;
    for (int64_t h = h0; h < h1; h++)
        head_rows(a, a->q, h, i0, nq, S + (h - h0) * nq * nk, nk, rows + (h - h0) * nq);
    if (a->mix) { /* (one head per task) */
        float *A = j->c->mixed[thread];
        attn_mix_probs(a, i0, nq, h0, lo, nk, S, A);
        for (int64_t i = 0; i < nq; i++)
            rows[i].s = A + i * nk;
        S = A;
    } else {
        attn_scores(a, rows, n, g, lo, nk);
        for (int64_t h = h0; h < h1; h++)
            attn_softmax_rows(a, i0, nq, lo, nk, S + (h - h0) * nq * nk);
    }

    const fitm_capture *cap = a->capture;
    const fitm_intervention *iv = a->intervention;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t p = a->pos0 + i0 + i;
            float *row = S + ((h - h0) * nq + i) * nk;
            const int32_t r = cap ? a->cap_index[i0 + i] : -1;
            const bool intervene = iv && p >= iv->from_pos;
            if (r >= 0 && !(intervene && cap->after_intervention))
                capture_row(a, h, r, p, row, lo, nk);
            if (intervene) {
                fitm_ops_intervene(row, lo, nk, iv->spans, iv->alpha, iv->n_spans,
                                   j->c->mass[thread]);
                if (r >= 0 && cap->after_intervention)
                    capture_row(a, h, r, p, row, lo, nk);
            }
        }
    attn_pv(a, rows, n, g, lo, nk);
}

/* Heads per task for a call of T rows: 1 (a task per head and tile of TILE_Q rows), or, for
 * calls of a few rows (decode steps), several heads of one KV group in one task so that each
 * K and V row is read once for all of them. The heads of a group are split in halves while
 * there are fewer tasks than threads; each task's scores must fit its TILE_Q rows. */
static int64_t heads_per_task(const cpu_backend *c, const fitm_attn_args *a)
{
    const int64_t H = a->n_head, group = H / a->n_head_kv;
    if (a->mix || group < 2 || a->T > TILE_Q)
        return 1;
    int64_t per = group;
    while (per % 2 == 0 && H / per < c->n_threads)
        per /= 2;
    while (per > 1 && per * a->T > TILE_Q)
        per = per % 2 == 0 ? per / 2 : 1;
    return per;
}

static int64_t attn_tasks(const attn_job *j)
{
    return j->heads_per_task > 1 ? j->a->n_head / j->heads_per_task : j->a->n_head * j->n_tiles;
}

static void cpu_attention(fitm_backend *b, const fitm_attn_args *a)
{
    cpu_backend *c = cpu(b);
    attn_job j = {c, a, (a->T + TILE_Q - 1) / TILE_Q, heads_per_task(c, a)};
    fitm_pool_run(c->pool, attn_tasks(&j), attn_task, &j);
}

#define ATTN_MANY_MAX 64

/* The calls of one attention_many job: call s's tasks are [first[s], first[s + 1]). */
typedef struct {
    attn_job job[ATTN_MANY_MAX];
    int64_t first[ATTN_MANY_MAX + 1];
} attn_many_job;

static void attn_many_task(void *ctx, int64_t task, int thread)
{
    const attn_many_job *m = ctx;
    int s = 0;
    while (task >= m->first[s + 1])
        s++;
    attn_task((void *)&m->job[s], task - m->first[s], thread);
}

/* Several sequences' attention as one pool job. With at least as many calls as threads the
 * threads have enough tasks without splitting a KV group's heads, so a decode row's task
 * takes every head of its group and reads each K and V row once (cpu_attention splits them
 * to keep both threads busy, and both read the rows). A row's result is the same however its
 * heads are grouped: each head's dots and sums are formed alike in every grouping. */
static void cpu_attention_many(fitm_backend *b, const fitm_attn_args *a, int n)
{
    cpu_backend *c = cpu(b);
    for (int s0 = 0; s0 < n; s0 += ATTN_MANY_MAX) {
        const int k = n - s0 < ATTN_MANY_MAX ? n - s0 : ATTN_MANY_MAX;
        attn_many_job m;
        m.first[0] = 0;
        for (int s = 0; s < k; s++) {
            const fitm_attn_args *as = &a[s0 + s];
            const int64_t group = as->n_head / as->n_head_kv;
            int64_t per = heads_per_task(c, as);
            if (k >= c->n_threads && per > 1 && group * as->T <= TILE_Q)
                per = group;
            m.job[s] = (attn_job){c, as, (as->T + TILE_Q - 1) / TILE_Q, per};
            m.first[s + 1] = m.first[s] + attn_tasks(&m.job[s]);
        }
        fitm_pool_run(c->pool, m.first[k], attn_many_task, &m);
    }
}

/* ---- creation ---------------------------------------------------------------------------- */

static const fitm_backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .reserve = cpu_reserve,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .to_half = cpu_to_half,
    .from_half = cpu_from_half,
    .prepare = cpu_prepare,
    .release = cpu_release,
    .embed = cpu_embed,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .glu = cpu_glu,
    .add = cpu_add,
    .softcap = cpu_softcap,
    .topk = cpu_topk,
    .logprob = cpu_logprob,
    .attention = cpu_attention,
    .attention_many = cpu_attention_many,
    .attention_mix = true,
    .capture_add = true,
    .kv_half = true,
};

#define CPU_CAT_(a, b) a##_##b
#define CPU_CAT(a, b) CPU_CAT_(a, b)

fitm_status CPU_CAT(fitm_backend_cpu_create, FITM_CPU_SUFFIX)(fitm_backend **out, int n_threads,
                                                              fitm_err *err);
fitm_status CPU_CAT(fitm_backend_cpu_create, FITM_CPU_SUFFIX)(fitm_backend **out, int n_threads,
                                                              fitm_err *err)
{
    *out = NULL;
    cpu_backend *c = calloc(1, sizeof *c);
    if (!c)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the CPU backend");
    c->base.ops = &cpu_ops;
    fitm_status s = fitm_pool_create(&c->pool, n_threads, err);
    if (s) {
        free(c);
        return s;
    }
    c->n_threads = n_threads;
    *out = &c->base;
    return FITM_OK;
}
