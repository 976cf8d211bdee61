/* backend_cuda: the backend vtable (backend.h) on a CUDA device, over the kernels of kernels/
 * (kernels.h).
 *
 * Weights: prepare uploads every tensor of the model once, in its stored type, and keeps a
 * table from the host view's data address to the device copy; a weight view that is not in
 * the table (tests hand in their own) is copied to a scratch buffer for the one call. The
 * table holds one model: preparing another releases the previous model's copies.
 * Products, by the driver's numerics class (backend.h, matmul): STEP calls (decode steps) run
 * every row as one warp-per-output dot product over the stored weight (fitm_cuda_matmul_rows).
 * BATCH calls (prefill, reference passes), by fitm_backend_cuda_set_weights: BF16 (the default)
 * multiplies bfloat16 operands with F32 accumulation on the tensor cores in one launch of the
 * project's GEMM per call (fitm_cuda_gemm_bf16: every row, and a layer's Q, K and V or gate and
 * up side by side), each layer matrix rounded to bfloat16 once at prepare (kept beside the
 * stored copy: 2 bytes per weight, bf16_bytes) and the activations rounded into scratch by a
 * conversion launch first (fitm_cuda_to_bf16; bfloat16 keeps F32's exponent range: Gemma's
 * activations, which overflow half, fit); F32 dequantizes the weight to F32 in a device
 * scratch buffer per call and multiplies F32 in and out with cuBLAS in calls of a fixed row
 * count (below, gemm_rows) with F32 pedantic compute (no TF32).
 * Attention: in a batched call with BF16 (fitm_attn_args.batched), the plain rows (no capture,
 * no intervention, no mixture: a prompt's bulk) go to fitm_cuda_attention_bf16 (bfloat16 on
 * the tensor cores, row-invariant with bits of its own); otherwise runs of plain rows of at
 * least a tile's rows go to fitm_cuda_attention_tiled (blocks of rows and a KV group's heads
 * reading each key and value once). The other rows go to fitm_cuda_attention_rows (one block
 * per (row, head)), whose bits the tiled kernel's equal, so which of those two ran a row
 * never shows. Captured
 * rows are copied on the stream into a pinned area and reach the caller's host arrays at the
 * next wait (fetch_late), so a captured pass waits no more than a plain one.
 *
 * Launches: the ops enqueue work without waiting, and the host waits where it needs a result
 * (a download, the status). Between two waits the stream is captured into a CUDA graph
 * (capture_on), from the first op on, and the graph replayed as one submission at the next
 * wait: a decode step's hundreds of kernels, copies and staged uploads then cost the host one
 * graph launch instead of one launch each, and the device runs them back to back. Graphs are
 * kept per shape (node count) and updated with each step's arguments (cudaGraphExecUpdate:
 * positions, cache rows and staged addresses change every step, the kernels do not); a shape
 * not seen before is instantiated. An op that cannot be captured (a cuBLAS product, an
 * allocation, a copy from pageable memory, a wait) first submits what was captured, and the
 * rest of the pass runs uncaptured: with F32 products a prefill's first BATCH product ends its
 * capture after a few ops; the bfloat16 GEMM is an ordinary launch, so with BF16 a prefill is
 * captured up to its first wait. Replay runs the same operations in the same order on the
 * same data, so results are bit for bit those of the uncaptured path
 * (fitm_backend_cuda_set_graphs turns it off). Work equal to an instance's last capture, item
 * for item (kernels, configurations, argument bytes, copy and memset addresses: the tapes of
 * kernels.h), is not captured at all: it is held back from the wait's first op on and, at the
 * next wait, that instance is launched again (replay_start, replay_end); work that differs
 * is captured from its first item as before. With fitm_backend_cuda_set_pieces the work
 * between two waits goes out as several graphs of about that many ops each, so the device
 * starts on the first while the host still captures the next: each piece number keeps its
 * own instances.
 *
 * Fusion (on by default; fitm_backend_cuda_set_fusion): neighbouring ops of a step run as
 * one kernel with the arithmetic of the separate ones, so the bits do not change: the residual
 * add with the next rmsnorm (kept pending until that arrives), and with the post-norm before
 * it where the model has one (the norm kept pending too), a STEP call's products of one
 * input (Q, K, V) as one launch, a bfloat16 BATCH call's products of one input (Q, K, V; gate
 * and up) as one launch, the per-head norms with RoPE (qk_rope), a STEP call's gate and up
 * products with the GLU (matmul_glu), a step's K and V stores into every sequence's cache
 * (kv_store_many: one launch a layer instead of two copies per sequence).
 *
 * Memory: alloc hands out device memory zeroed in stream order; free keeps it in a pool for
 * the next alloc it fits (cuda_alloc), so a request's KV caches cost no cudaMalloc, cudaFree
 * or device synchronisation once the pool holds their size.
 *
 * Errors: the ops return nothing, so the first CUDA error is recorded, later ops of the pass
 * do nothing, and the status slot reports it (FITM_ERR_BACKEND, or FITM_ERR_NOMEM) and clears
 * it, unless the error is sticky (the context is lost): then every later status call fails. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "base/clock.h"
#include "kernels.h"
#include "model/backend_cuda.h"

typedef struct {
    const void *host; /* the view's data address: the key */
    void *dev;
    uint16_t *bf16; /* with FITM_CUDA_WEIGHTS_BF16, a matrix of the BATCH class: (N, K) rounded
                       to bfloat16 at prepare; else NULL */
} dev_weight;

typedef struct {
    void *p;
    size_t cap;
} grow_buf;

/* A device allocation of n bytes that alloc handed out (live) or that free kept (pool). */
typedef struct {
    void *p;
    size_t n;
} dev_block;

/* Freed allocations kept for reuse (cuda_alloc): at most POOL_BLOCKS of them and pool_cap
 * bytes (a quarter of the device's memory), the oldest released first. */
#define POOL_BLOCKS 16

/* An instantiated graph: a step's work, or its piece-th piece (fitm_backend_cuda_set_pieces),
 * of one shape (its node count), and when it last ran; tape: the work of the capture the
 * instance was last made or updated from, item for item (empty when not known: then the
 * instance is never launched again without a capture). */
typedef struct {
    cudaGraphExec_t exec;
    size_t nodes;
    int piece;
    uint64_t used;
    fitm_cuda_tape *tape;
} graph_slot;

/* Instances kept: a few shapes' work (a decode step of each batch size, prompts), each in up
 * to GRAPH_PIECES pieces. */
#define GRAPH_SLOTS 32
#define GRAPH_PIECES 8
/* Submissions after which an instance may be updated with other work (graph_slot_for). */
#define GRAPH_RECENT 8

/* A captured row on its way to the caller's array dst: n floats at off floats into the pinned
 * download area, added onto dst (capture->add) or copied. */
typedef struct {
    float *dst;
    size_t off;
    int64_t n;
    bool add;
} late_copy;

/* Capture states: the stream is not captured and the next capturable op starts a capture
 * (IDLE), is captured (ON), or is not captured until the next wait (OFF: some op of this
 * pass could not be); or its work is held back and compared with the instances' tapes
 * (SPEC: replay_start). */
enum { CAP_IDLE, CAP_ON, CAP_OFF, CAP_SPEC };

_Static_assert(GRAPH_SLOTS <= FITM_CUDA_TAPE_CANDIDATES, "every instance may be a candidate");

typedef struct {
    fitm_backend base;
    cudaStream_t stream;
    cublasHandle_t blas;
    int rc;      /* first error of the pass (a cudaError_t value), 0 none */
    bool sticky; /* rc left the context unusable */
    char what[96];
    char device[320]; /* name, compute capability, memory: for the log */
    dev_weight *w;    /* sorted by host */
    size_t n_w;
    grow_buf tmp_w[2], wf, xpad, ypad, ids, cap_index, cap_spans, iv_spans, iv_alpha, cap_mass,
        cap_probs, top, top_scratch, many, picks, lp, kv_rows;
    void *host; /* host scratch: the top entries' values then indices, unpacked into the
                   caller's array */
    size_t host_cap;
    uint8_t *pin; /* pinned staging of the small host arrays an op hands the device (stage) */
    size_t pin_cap, pin_used;
    /* captured rows on their way to the caller's arrays (fetch_late): copied into the pinned
     * area dl in stream order, then into (or onto) their destinations by the next wait */
    float *dl;
    size_t dl_cap, dl_used; /* floats */
    late_copy *late;
    size_t n_late, late_cap;
    bool graphs;         /* capture the work between two waits and replay it (capture_on) */
    bool fuse;           /* run neighbouring ops as one kernel (fitm_backend_cuda_set_fusion) */
    bool pdl_ok;         /* the device passed fitm_cuda_pdl_probe: launches may be programmatic */
    fitm_backend_ops ops; /* cuda_ops, less the fused slots when fuse is off */
    int cap;             /* CAP_IDLE, CAP_ON or CAP_OFF */
    int piece_ops;       /* > 0: a capture is submitted once this many ops are in it, and the
                            next op begins the next piece (fitm_backend_cuda_set_pieces) */
    int cap_ops;         /* ops in the capture under way */
    int piece;           /* pieces submitted since the last wait */
    bool busy;           /* work may have been enqueued since the last wait */
    /* a residual add not launched yet (n 0: none): y += x, fused into the next rmsnorm of y
     * (fitm_cuda_add_rmsnorm) when that follows, else launched before the next op's work */
    struct {
        float *y;
        const float *x;
        int64_t n;
    } add;
    /* an rmsnorm not launched yet (rows 0: none; its weight w resident): y = rmsnorm(x) * w.
     * A block's post-norm: when the add of y follows (kept pending beside it) and then a norm
     * of that sum, the three run as one kernel (fitm_cuda_norm_add_rmsnorm); else launched
     * before the next op's work. When both are pending, the norm came first. */
    struct {
        float *y;
        const float *x;
        const void *w;
        int64_t rows, n;
        float eps;
    } norm;
    /* a layer's KV stores not launched yet (n 0: none), their descriptors not staged yet:
     * done by the attention launch of the step that follows (attention_staged, the
     * descriptors staged with its arguments), else staged at kv_rows and launched before the
     * next op's work */
    struct {
        fitm_cuda_kv_rows k[FITM_CUDA_KV_ROWS_MAX];
        int n;
    } kv;
    graph_slot slots[GRAPH_SLOTS];
    uint64_t clock;      /* of the slots' last use */
    /* the work of the capture under way (recording: it is being recorded), or in CAP_SPEC the
     * work held back; and the slots whose tapes CAP_SPEC compares with, in the order given */
    fitm_cuda_tape *rec;
    bool recording;
    int cand_slot[GRAPH_SLOTS];
    /* the BATCH class's operands (fitm_backend_cuda_set_weights): what it multiplies in, the
     * prepared model's bfloat16 copies' bytes, the bfloat16 scratch of a weight without a
     * copy (wb) and of the activations a product multiplies (xb) */
    fitm_cuda_weights weights;
    size_t bf16_bytes;
    grow_buf wb, xb;
    fitm_backend_cuda_stats stats;
    dev_block *live; /* what alloc handed out and free has not taken back */
    size_t n_live, live_cap;
    dev_block pool[POOL_BLOCKS]; /* oldest first */
    int n_pool;
    size_t pool_bytes, pool_cap;
} cuda_backend;

static cuda_backend *cu(fitm_backend *b)
{
    return (cuda_backend *)b;
}

/* Records rc as the pass's error when it is the first; true when the pass may go on. */
static bool ok(cuda_backend *c, int rc, const char *what)
{
    if (rc != 0 && c->rc == 0) {
        c->rc = rc;
        c->sticky = fitm_cuda_error_is_sticky(rc);
        snprintf(c->what, sizeof c->what, "%s", what);
    }
    return c->rc == 0;
}

static bool capture_off(cuda_backend *c);
static cudaError_t dev_malloc(cuda_backend *c, void **p, size_t n);

/* Makes the device buffer g at least bytes long (its contents are not kept). */
static bool grow(cuda_backend *c, grow_buf *g, size_t bytes)
{
    if (g->cap >= bytes)
        return c->rc == 0;
    if (!capture_off(c)) /* no allocation inside a capture */
        return false;
    if (g->p && !ok(c, (int)cudaFree(g->p), "free scratch"))
        return false;
    g->p = NULL;
    g->cap = 0;
    if (!ok(c, (int)dev_malloc(c, &g->p, bytes), "scratch allocation"))
        return false;
    g->cap = bytes;
    return true;
}

/* Enqueues a copy of n bytes from the host to the device. src must be pinned (the staging
 * area) or the caller must have ended any capture (capture_off). */
static bool to_dev(cuda_backend *c, void *dst, const void *src, size_t n, const char *what)
{
    return n == 0 ||
           ok(c, fitm_cuda_copy_async(dst, src, n, cudaMemcpyHostToDevice, c->stream), what);
}

/* ---- graphs ---------------------------------------------------------------------------------- */

/* Starts capturing the stream if graphs are on and no capture is under way or ruled out for
 * this pass: every op that enqueues only capturable work calls it first. */
static void pending_flush(cuda_backend *c);

static bool graph_submit(cuda_backend *c);

/* Begins capturing the stream (CAP_ON), its work recorded after what c->rec holds when
 * graphs are submitted whole (no pieces); where the capture cannot begin, the pass runs
 * uncaptured (CAP_OFF). */
static void capture_begin(cuda_backend *c)
{
    /* thread-local: other threads' CUDA calls (another backend's) do not break it */
    if (cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
        c->cap = CAP_ON;
        c->cap_ops = 1;
        c->recording = c->piece_ops == 0 && fitm_cuda_tape_record(c->rec, c->stream);
    } else {
        (void)cudaGetLastError(); /* not an error of the pass: it runs uncaptured */
        c->cap = CAP_OFF;
    }
}

/* Replay: after a wait, with graphs submitted whole, the pass's work is held back and
 * compared with the tapes of the instances (candidates: the most recently used first; each
 * item keeps those whose items so far it all equals) instead of being captured (CAP_SPEC),
 * until the next wait or op that cannot be captured (replay_end). False when there is no
 * candidate. */
static bool replay_start(cuda_backend *c)
{
    if (c->piece_ops > 0)
        return false;
    int n = 0;
    for (int i = 0; i < GRAPH_SLOTS; i++) {
        const graph_slot *s = &c->slots[i];
        if (!s->exec || s->piece != 0 || fitm_cuda_tape_length(s->tape) == 0)
            continue;
        int j = n++;
        for (; j > 0 && c->slots[c->cand_slot[j - 1]].used < s->used; j--)
            c->cand_slot[j] = c->cand_slot[j - 1];
        c->cand_slot[j] = i;
    }
    fitm_cuda_tape *cands[GRAPH_SLOTS];
    for (int k = 0; k < n; k++)
        cands[k] = c->slots[c->cand_slot[k]].tape;
    if (n == 0 || !fitm_cuda_tape_expect(c->rec, c->stream, cands, n))
        return false;
    c->cap = CAP_SPEC;
    return true;
}

static bool graph_replay(cuda_backend *c, graph_slot *s);

/* Ends CAP_SPEC. Work equal to a candidate's tape, item for item and as many items, is that
 * candidate's instance launched again: it holds exactly this work (staged copies read the
 * bytes staged now), and nothing is captured or updated. Any other work goes on the stream
 * as it would have without the holding back: captured from its first item (the items held
 * back, then what follows) or, where the capture cannot begin, uncaptured. The work of a
 * failed pass is dropped. */
static bool replay_end(cuda_backend *c)
{
    if (c->rc) {
        fitm_cuda_tape_stop(c->stream);
        c->cap = CAP_OFF;
        return false;
    }
    const int k = fitm_cuda_tape_matched(c->stream);
    if (k >= 0) {
        fitm_cuda_tape_stop(c->stream);
        c->cap = CAP_OFF;
        return graph_replay(c, &c->slots[c->cand_slot[k]]);
    }
    fitm_cuda_tape_unwind(c->stream); /* c->rec: all the work held back */
    capture_begin(c);
    return ok(c, fitm_cuda_tape_run(c->rec, c->stream), "held-back work");
}

static void capture_on(cuda_backend *c)
{
    c->busy = true;
    pending_flush(c);
    if (c->cap == CAP_ON && c->piece_ops > 0 && ++c->cap_ops > c->piece_ops &&
        c->piece < GRAPH_PIECES - 1) {
        /* this piece is full: the device runs it while the host captures the next */
        if (!graph_submit(c))
            return;
        c->cap = CAP_IDLE;
    }
    if (!c->graphs || c->cap != CAP_IDLE || c->rc || replay_start(c))
        return;
    fitm_cuda_tape_clear(c->rec);
    capture_begin(c);
}

/* An instance for the captured graph g of n nodes, the piece-th piece since the last wait:
 * one of that piece number and node count that takes g's arguments (cudaGraphExecUpdate,
 * tried from the least recently used; shapes of other kernels may have the same count, and
 * keep instances of their own), else the least recently used slot, to hold a new instance.
 * With replay (graphs submitted whole), an instance launched in the last GRAPH_RECENT
 * submissions is not updated: shapes of one count that alternate (decode steps of 2 and 3
 * sequences, whose stores and attention are one launch each) then each keep the instance
 * they replay, where updating one with the other's arguments would leave neither
 * replayable; work that matches no instance step after step (nothing replayable) makes at
 * most GRAPH_RECENT instances before it updates the oldest. A slot is used once between
 * two waits (its piece number; at most GRAPH_PIECES of them, the least recently used being
 * older), so no instance is running when it is updated or replaced. */
static graph_slot *graph_slot_for(cuda_backend *c, cudaGraph_t g, int piece, size_t n,
                                  bool *updated)
{
    graph_slot *lru = &c->slots[0], *same[GRAPH_SLOTS];
    int n_same = 0;
    *updated = false;
    uint64_t newest = UINT64_MAX; /* the last use of an instance that may be updated */
    if (c->piece_ops == 0)
        newest = c->clock > GRAPH_RECENT ? c->clock - GRAPH_RECENT : 0;
    for (int i = 0; i < GRAPH_SLOTS; i++) {
        graph_slot *s = &c->slots[i];
        if (s->exec && s->nodes == n && s->piece == piece && s->used <= newest) {
            int j = n_same++; /* by last use, oldest first */
            for (; j > 0 && same[j - 1]->used > s->used; j--)
                same[j] = same[j - 1];
            same[j] = s;
        }
        if (s->used < lru->used)
            lru = s;
    }
    for (int j = 0; j < n_same; j++) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(same[j]->exec, g, &info) == cudaSuccess) {
            *updated = true;
            return same[j];
        }
        (void)cudaGetLastError(); /* refused: another shape's instance, left as it was */
        /* and no replay of it, in case the runtime changed it all the same */
        fitm_cuda_tape_clear(same[j]->tape);
    }
    return lru;
}

/* Ends the capture under way and submits what it holds as one graph launch: the instance of
 * its shape updated with its arguments, or a new instance where there is none or the update
 * is refused (different kernels, or a different order). */
static void capture_drop(cuda_backend *c);

static bool graph_launch(cuda_backend *c, cudaGraph_t g, bool recorded);

static bool graph_submit(cuda_backend *c)
{
    if (c->rc) { /* the pass failed: its captured work is not run */
        capture_drop(c);
        c->cap = CAP_OFF;
        return false;
    }
    const bool recorded = c->recording;
    fitm_cuda_tape_stop(c->stream);
    c->recording = false;
    c->cap = CAP_OFF;
    const int64_t t0 = fitm_clock_ns();
    cudaGraph_t g = NULL;
    const bool done = ok(c, (int)cudaStreamEndCapture(c->stream, &g), "graph capture") &&
                      graph_launch(c, g, recorded);
    c->stats.submit_ns += (uint64_t)(fitm_clock_ns() - t0);
    return done;
}

/* Launches the instance s again as it is (replay_end), counted as a graph launch and a
 * replay. */
static bool graph_replay(cuda_backend *c, graph_slot *s)
{
    const int64_t t0 = fitm_clock_ns();
    s->used = ++c->clock;
    c->piece++;
    c->stats.graph_launches++;
    c->stats.graph_replays++;
    const bool done = ok(c, (int)cudaGraphLaunch(s->exec, c->stream), "graph launch");
    c->stats.submit_ns += (uint64_t)(fitm_clock_ns() - t0);
    return done;
}

/* Runs the captured graph g (destroyed here): the instance of its shape updated with its
 * arguments, or a new instance. The instance's tape becomes c->rec when the capture was
 * recorded whole (recorded, and as many items as g has nodes: every node came through a
 * tape), else empty. */
static bool graph_launch(cuda_backend *c, cudaGraph_t g, bool recorded)
{
    size_t n = 0;
    if (!ok(c, (int)cudaGraphGetNodes(g, NULL, &n), "graph nodes")) {
        cudaGraphDestroy(g);
        return false;
    }
    if (n == 0) {
        cudaGraphDestroy(g);
        return true;
    }
    bool have;
    graph_slot *s = graph_slot_for(c, g, c->piece, n, &have);
    if (recorded && fitm_cuda_tape_length(c->rec) == n)
        fitm_cuda_tape_swap(s->tape, c->rec);
    else
        fitm_cuda_tape_clear(s->tape);
    if (have)
        c->stats.graph_updates++;
    if (!have) {
        if (s->exec)
            cudaGraphExecDestroy(s->exec);
        s->exec = NULL;
        if (!ok(c, (int)cudaGraphInstantiate(&s->exec, g, 0), "graph instantiation")) {
            s->exec = NULL;
            cudaGraphDestroy(g);
            return false;
        }
        s->nodes = n;
        s->piece = c->piece;
        c->stats.graph_instantiations++;
    }
    s->used = ++c->clock;
    c->piece++;
    cudaGraphDestroy(g);
    c->stats.graph_launches++;
    return ok(c, (int)cudaGraphLaunch(s->exec, c->stream), "graph launch");
}

/* Submits the capture under way, if any, and keeps the stream uncaptured until the next wait:
 * called before work that cannot be captured. False on an error (recorded). Every op calls
 * this or capture_on first, so both mark the stream busy (cuda_status waits only then). */
static bool capture_off(cuda_backend *c)
{
    c->busy = true;
    pending_flush(c);
    if (c->cap == CAP_SPEC && !replay_end(c))
        return false;
    if (c->cap == CAP_ON)
        return graph_submit(c);
    c->cap = c->cap == CAP_IDLE ? CAP_OFF : c->cap;
    return c->rc == 0;
}

/* Ends a capture, or the holding back of CAP_SPEC, without running what it holds (the work
 * of a pass that failed). */
static void capture_drop(cuda_backend *c)
{
    fitm_cuda_tape_stop(c->stream);
    c->recording = false;
    if (c->cap == CAP_ON) {
        cudaGraph_t g = NULL;
        if (cudaStreamEndCapture(c->stream, &g) == cudaSuccess && g)
            cudaGraphDestroy(g);
        (void)cudaGetLastError();
    }
    c->cap = CAP_IDLE;
}

/* Drops the capture under way and every instantiated graph (none may be running), and their
 * tapes. */
static void graphs_release(cuda_backend *c)
{
    capture_drop(c);
    for (int i = 0; i < GRAPH_SLOTS; i++) {
        if (c->slots[i].exec)
            cudaGraphExecDestroy(c->slots[i].exec);
        fitm_cuda_tape *t = c->slots[i].tape;
        if (t)
            fitm_cuda_tape_clear(t);
        c->slots[i] = (graph_slot){.tape = t};
    }
    if (c->rec)
        fitm_cuda_tape_clear(c->rec);
}

static bool sync_stream(cuda_backend *c, const char *what);

void fitm_backend_cuda_get_stats(const fitm_backend *b, fitm_backend_cuda_stats *out)
{
    *out = ((const cuda_backend *)b)->stats;
}

void fitm_backend_cuda_set_pieces(fitm_backend *b, int ops)
{
    cuda_backend *c = cu(b);
    sync_stream(c, "graphs");
    c->piece_ops = ops > 0 ? ops : 0;
}

bool fitm_backend_cuda_set_pdl(fitm_backend *b, bool on)
{
    cuda_backend *c = cu(b);
    sync_stream(c, "programmatic launches");
    graphs_release(c); /* an instance keeps the kind of launches it was captured with */
    fitm_cuda_set_pdl(c->stream, on && c->pdl_ok);
    return fitm_cuda_pdl(c->stream);
}

bool fitm_backend_cuda_pdl(const fitm_backend *b)
{
    return fitm_cuda_pdl(((const cuda_backend *)b)->stream);
}

void fitm_backend_cuda_set_graphs(fitm_backend *b, bool on)
{
    cuda_backend *c = cu(b);
    sync_stream(c, "graphs"); /* no instance is destroyed while it runs */
    graphs_release(c);
    c->graphs = on;
}

/* Forgets the captured rows on their way to the caller's arrays (fetch_late). */
static void late_drop(cuda_backend *c)
{
    c->n_late = 0;
    c->dl_used = 0;
}

/* Puts the captured rows that arrived in dl into the caller's arrays, in the order they were
 * asked for (so rows added onto others, capture->add, are summed as one copy after the other
 * would have summed them). Only after the stream's work is done. */
static void late_flush(cuda_backend *c)
{
    for (size_t i = 0; i < c->n_late; i++) {
        const late_copy *l = &c->late[i];
        const float *src = c->dl + l->off;
        if (l->add)
            for (int64_t j = 0; j < l->n; j++)
                l->dst[j] += src[j];
        else
            memcpy(l->dst, src, (size_t)l->n * sizeof(float));
    }
    late_drop(c);
}

/* Waits for the stream's work (what a capture under way holds is submitted first). Every
 * staged copy is then done, so the whole pinned staging area is free again (stage), the
 * captured rows reach the caller's arrays (late_flush), and the next op may start a capture. */
static bool sync_stream(cuda_backend *c, const char *what)
{
    capture_off(c);
    const int64_t t0 = fitm_clock_ns();
    const int rc = (int)cudaStreamSynchronize(c->stream);
    c->piece = 0;
    c->stats.waits++;
    c->stats.wait_ns += (uint64_t)(fitm_clock_ns() - t0);
    if (!ok(c, rc, what)) {
        late_drop(c); /* the pass failed: its captures are not delivered */
        return false;
    }
    late_flush(c);
    c->pin_used = 0;
    c->cap = CAP_IDLE;
    c->busy = false;
    return true;
}

/* Host copy of n bytes; synchronous (the stream's work before it is done). */
static bool to_host(cuda_backend *c, void *dst, const void *src, size_t n, const char *what)
{
    if (n == 0 || c->rc)
        return c->rc == 0;
    if (!capture_off(c) || /* into pageable memory: not in a graph */
        !ok(c, fitm_cuda_copy_async(dst, src, n, cudaMemcpyDeviceToHost, c->stream), what))
        return false;
    return sync_stream(c, what);
}

#define PIN_MIN_BYTES (256u << 10)

static size_t align64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

/* Copies bytes of a host array the caller owns (token ids, spans, Eq. 5 weights) to the device
 * address dev without waiting for the stream: the bytes go to the next free part of the pinned
 * staging area, and the device copies them from there when the stream reaches the copy. The
 * caller may reuse its array at once; the area's part stays as written until the next
 * sync_stream, after which every staged copy is done. A decode step of B sequences thus
 * waits for the device once (its top-k download), not after every layer's attention. The
 * device bytes are reused in stream order: a later stage writes them after the kernels
 * before it have read them. False on an error (recorded). */
static bool stage_at(cuda_backend *c, void *dev, const void *host, size_t bytes)
{
    if (bytes == 0)
        return c->rc == 0;
    const size_t need = align64(bytes);
    if (c->pin_used + need > c->pin_cap) {
        if (!sync_stream(c, "staging")) /* the area is all free after it */
            return false;
        if (need > c->pin_cap) {
            if (c->pin)
                cudaFreeHost(c->pin);
            c->pin = NULL;
            c->pin_cap = 0;
            const size_t cap = need > PIN_MIN_BYTES ? need : PIN_MIN_BYTES;
            if (!ok(c, (int)cudaMallocHost((void **)&c->pin, cap), "pinned staging allocation"))
                return false;
            c->pin_cap = cap;
        }
    }
    uint8_t *src = c->pin + c->pin_used;
    memcpy(src, host, bytes);
    c->pin_used += need;
    return to_dev(c, dev, src, bytes, "staging copy");
}

/* stage_at the start of the growing buffer g: its device address, or NULL. */
static void *stage(cuda_backend *c, grow_buf *g, const void *host, size_t bytes)
{
    return grow(c, g, bytes ? bytes : 1) && stage_at(c, g->p, host, bytes) ? g->p : NULL;
}

/* ---- weights ------------------------------------------------------------------------------ */

static size_t weight_bytes(const fitm_weight *w)
{
    return (size_t)w->n_rows * w->row_bytes;
}

static const dev_weight *find_weight(const cuda_backend *c, const void *host)
{
    size_t lo = 0, hi = c->n_w;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c->w[mid].host == host)
            return &c->w[mid];
        if ((uintptr_t)c->w[mid].host < (uintptr_t)host)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* The device copy of w: the resident one, or a copy in scratch slot `slot` for this call. */
static const void *weight_dev(cuda_backend *c, const fitm_weight *w, int slot)
{
    const dev_weight *d = find_weight(c, w->data);
    if (d)
        return d->dev;
    const size_t n = weight_bytes(w);
    if (!grow(c, &c->tmp_w[slot], n) || !capture_off(c) || /* pageable source */
        !to_dev(c, c->tmp_w[slot].p, w->data, n, "weight upload"))
        return NULL;
    return c->tmp_w[slot].p;
}

static int cmp_weight(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const dev_weight *)a)->host,
              y = (uintptr_t)((const dev_weight *)b)->host;
    return x < y ? -1 : x > y;
}

static fitm_status add_weight(cuda_backend *c, const fitm_weight *w, size_t cap, fitm_err *err)
{
    if (!w->data || find_weight(c, w->data))
        return FITM_OK;
    for (size_t i = 0; i < c->n_w; i++) /* not yet sorted: a tied output is added twice */
        if (c->w[i].host == w->data)
            return FITM_OK;
    if (!fitm_cuda_dequant_supported(w->type))
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED, "CUDA backend: tensor '%s' has type %d",
                            w->name ? w->name : "?", (int)w->type);
    if (c->n_w == cap)
        return fitm_err_set(err, FITM_ERR_INTERNAL, "CUDA backend: weight table full");
    void *dev = NULL;
    const size_t n = weight_bytes(w);
    int rc = (int)dev_malloc(c, &dev, n ? n : 1);
    if (rc == 0)
        rc = (int)cudaMemcpy(dev, w->data, n, cudaMemcpyHostToDevice);
    if (rc != 0) {
        cudaFree(dev);
        char what[128];
        snprintf(what, sizeof what, "uploading '%s'", w->name ? w->name : "?");
        return fitm_cuda_status(rc, err, what);
    }
    c->w[c->n_w++] = (dev_weight){w->data, dev, NULL};
    return FITM_OK;
}

static void release_weights(cuda_backend *c)
{
    for (size_t i = 0; i < c->n_w; i++) {
        cudaFree(c->w[i].dev);
        if (c->w[i].bf16)
            cudaFree(c->w[i].bf16);
    }
    c->n_w = 0;
    c->bf16_bytes = 0;
}

static bool to_bf16(cuda_backend *c, const fitm_weight *w, const void *W, uint16_t *dst);

/* The bfloat16 copy of the resident weight w (its (N, K) values dequantized to F32 in scratch,
 * then rounded), kept beside the stored one; synchronous, counted in bf16_bytes. */
static fitm_status add_bf16(cuda_backend *c, const fitm_weight *w, fitm_err *err)
{
    dev_weight *d = NULL;
    for (size_t i = 0; i < c->n_w && !d; i++) /* the table is not sorted yet */
        if (c->w[i].host == w->data)
            d = &c->w[i];
    if (!d || d->bf16)
        return FITM_OK; /* absent (an optional view), or a second view of one matrix */
    const size_t n = (size_t)(w->n_rows * w->n_cols) * sizeof(uint16_t);
    int rc = (int)dev_malloc(c, (void **)&d->bf16, n ? n : 1);
    if (rc == 0 &&
        (!to_bf16(c, w, d->dev, d->bf16) || cudaStreamSynchronize(c->stream) != cudaSuccess)) {
        rc = c->rc ? c->rc : (int)cudaGetLastError();
        if (!c->sticky) /* reported here, not by the next pass's status */
            c->rc = 0, c->what[0] = 0;
    }
    if (rc != 0) {
        cudaFree(d->bf16);
        d->bf16 = NULL;
        char what[160];
        snprintf(what, sizeof what,
                 "CUDA backend: converting '%s' to bfloat16 (gpu_weights f32 keeps no copies)",
                 w->name ? w->name : "?");
        return fitm_cuda_status(rc, err, what);
    }
    c->bf16_bytes += n;
    return FITM_OK;
}

/* With FITM_CUDA_WEIGHTS_BF16, the bfloat16 copies of every matrix the BATCH class multiplies
 * by: each layer's projections (the output head is always a STEP product). */
static fitm_status add_bf16_layers(cuda_backend *c, const fitm_model *m, fitm_err *err)
{
    if (c->weights != FITM_CUDA_WEIGHTS_BF16)
        return FITM_OK;
    fitm_status s = FITM_OK;
    for (int32_t l = 0; l < fitm_model_config_of(m)->n_layer && !s; l++) {
        const fitm_layer *ly = fitm_model_layer(m, l);
        const fitm_weight *mats[] = {&ly->wq,     &ly->wk,   &ly->wv,    &ly->wo,
                                     &ly->w_gate, &ly->w_up, &ly->w_down};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0] && !s; i++)
            if (mats[i]->data)
                s = add_bf16(c, mats[i], err);
    }
    if (c->wf.p) /* the conversion's F32 staging: the BF16 path does not use it */
        cudaFree(c->wf.p);
    c->wf = (grow_buf){0};
    return s;
}

/* Uploads every weight of m (releasing the previous model's). */
static fitm_status cuda_prepare(fitm_backend *b, const fitm_model *m, fitm_err *err)
{
    cuda_backend *c = cu(b);
    capture_off(c);
    const size_t cap = (size_t)fitm_model_n_weights(m);
    /* One model at a time: the previous model's views may be gone and their addresses
     * reused by this one's (forwards of the same model find the fresh copies). */
    release_weights(c);
    dev_weight *w = realloc(c->w, cap * sizeof *w);
    if (!w)
        return fitm_err_set(err, FITM_ERR_NOMEM, "CUDA backend: weight table");
    c->w = w;
    fitm_status s = FITM_OK;
    for (size_t i = 0; i < cap && !s; i++)
        s = add_weight(c, fitm_model_weight_at(m, (int64_t)i), cap, err);
    if (s == FITM_OK)
        s = add_bf16_layers(c, m, err);
    qsort(c->w, c->n_w, sizeof *c->w, cmp_weight);
    return s;
}

/* ---- memory --------------------------------------------------------------------------------- */

/* A request's KV caches are allocated when it starts and freed when it ends: tens of MB each,
 * where cudaMalloc maps memory in the driver and cudaFree waits for the whole device. So a
 * freed allocation is kept in a pool and handed out again, zeroed on the stream, to the next
 * alloc it fits (at most a quarter larger than asked: no large block serves a small one). A
 * cudaMalloc that finds the device full releases the pool and tries once more, so the pool
 * never makes an allocation fail. */

/* Takes pooled block i out of the pool. */
static dev_block pool_take(cuda_backend *c, int i)
{
    const dev_block d = c->pool[i];
    c->pool_bytes -= d.n;
    memmove(&c->pool[i], &c->pool[i + 1], (size_t)(c->n_pool - i - 1) * sizeof c->pool[0]);
    c->n_pool--;
    return d;
}

/* Releases pooled block i (the device waits in cudaFree). */
static void pool_release(cuda_backend *c, int i)
{
    capture_off(c);
    cudaFree(pool_take(c, i).p);
}

/* cudaMalloc, with the pool released and a second try when the device is full. */
static cudaError_t dev_malloc(cuda_backend *c, void **p, size_t n)
{
    cudaError_t e = cudaMalloc(p, n);
    if (e == cudaErrorMemoryAllocation && c->n_pool > 0) {
        (void)cudaGetLastError();
        while (c->n_pool > 0)
            pool_release(c, c->n_pool - 1);
        e = cudaMalloc(p, n);
    }
    return e;
}

/* Zeroed device memory of n bytes, in stream order (later ops see zeros; no wait). */
static void *cuda_alloc(fitm_backend *b, size_t n)
{
    cuda_backend *c = cu(b);
    n = n ? n : 1;
    if (c->n_live == c->live_cap) {
        const size_t cap = c->live_cap ? 2 * c->live_cap : 64;
        dev_block *v = realloc(c->live, cap * sizeof *v);
        if (!v)
            return NULL;
        c->live = v;
        c->live_cap = cap;
    }
    capture_off(c); /* no allocation or memset inside a capture */
    int best = -1;  /* the smallest pooled block that fits */
    for (int i = 0; i < c->n_pool; i++)
        if (c->pool[i].n >= n && c->pool[i].n - n <= n / 4 &&
            (best < 0 || c->pool[i].n < c->pool[best].n))
            best = i;
    dev_block d = {NULL, n};
    if (best >= 0) {
        d = pool_take(c, best);
    } else if (dev_malloc(c, &d.p, n) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL; /* the caller reports it; not an error of the pass */
    }
    if (cudaMemsetAsync(d.p, 0, n, c->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFree(d.p);
        return NULL;
    }
    c->live[c->n_live++] = d;
    return d.p;
}

static void cuda_free(fitm_backend *b, void *p)
{
    cuda_backend *c = cu(b);
    if (!p)
        return;
    size_t i = 0;
    while (i < c->n_live && c->live[i].p != p)
        i++;
    if (i == c->n_live) { /* not alloc's: freed as it is */
        capture_off(c);
        cudaFree(p);
        return;
    }
    const dev_block d = c->live[i];
    c->live[i] = c->live[--c->n_live];
    if (d.n > c->pool_cap) {
        capture_off(c);
        cudaFree(d.p);
        return;
    }
    while (c->n_pool == POOL_BLOCKS || c->pool_bytes + d.n > c->pool_cap)
        pool_release(c, 0);
    c->pool[c->n_pool++] = d;
    c->pool_bytes += d.n;
}

#define UPLOAD_STAGED_MAX (64u << 10)

/* Copies n bytes of the caller's array to the device; the caller may reuse it at once. Up to
 * UPLOAD_STAGED_MAX bytes (a step's RoPE tables) go through the pinned staging area without a
 * wait (and into a capture); larger ones are copied and waited for. */
static void cuda_upload(fitm_backend *b, void *dst, const void *src_host, size_t n)
{
    cuda_backend *c = cu(b);
    if (n <= UPLOAD_STAGED_MAX) {
        capture_on(c);
        stage_at(c, dst, src_host, n);
        return;
    }
    if (capture_off(c) && to_dev(c, dst, src_host, n, "upload"))
        sync_stream(c, "upload"); /* src_host may go away */
}

/* Copies n bytes of device memory to the caller's array (waits). */
static void cuda_download(fitm_backend *b, void *dst_host, const void *src, size_t n)
{
    to_host(cu(b), dst_host, src, n, "download");
}

/* Device-to-device copy of n bytes, in stream order (no wait). */
static void cuda_copy(fitm_backend *b, void *dst, const void *src, size_t n)
{
    cuda_backend *c = cu(b);
    capture_on(c);
    if (n)
        ok(c, fitm_cuda_copy_async(dst, src, n, cudaMemcpyDeviceToDevice, c->stream), "copy");
}

/* A layer's K and V stores of a call's sequences (kv_store_many) as one launch per
 * FITM_CUDA_KV_ROWS_MAX of them: the descriptors staged into one device buffer, which the
 * kernel reads, so its arguments are the same from one decode step to the next (the rows it
 * writes are the staged bytes) and a step's graph can be replayed (docs/cuda-backend.md).
 * With fusion on, stores that fit one launch are kept pending instead: the decode step's
 * attention that follows does them in its own launch, their descriptors staged with its
 * arguments (attention_staged: one copy node a layer fewer as well). */
static void cuda_kv_store_many(fitm_backend *b, const fitm_kv_rows *r, int n)
{
    cuda_backend *c = cu(b);
    capture_on(c);
    fitm_cuda_kv_rows k[FITM_CUDA_KV_ROWS_MAX];
    if (!grow(c, &c->kv_rows, sizeof k))
        return;
    for (int s0 = 0; s0 < n && c->rc == 0; s0 += FITM_CUDA_KV_ROWS_MAX) {
        const int m = n - s0 < FITM_CUDA_KV_ROWS_MAX ? n - s0 : FITM_CUDA_KV_ROWS_MAX;
        for (int i = 0; i < m; i++) {
            const fitm_kv_rows *q = &r[s0 + i];
            k[i] = (fitm_cuda_kv_rows){q->k_dst, q->v_dst, q->k, q->v, q->n, q->half};
        }
        if (c->fuse && n == m) { /* staged when launched: with the attention's arguments */
            memcpy(c->kv.k, k, (size_t)m * sizeof *k);
            c->kv.n = m;
        } else if (stage_at(c, c->kv_rows.p, k, (size_t)m * sizeof *k)) {
            ok(c, fitm_cuda_kv_store_many(k, c->kv_rows.p, m, c->stream), "KV store");
        }
    }
}

static void free_buf(grow_buf *g)
{
    if (g->p)
        cudaFree(g->p);
    g->p = NULL;
    g->cap = 0;
}

/* Releases everything the backend holds on the device and the host. */
static void cuda_destroy(fitm_backend *b)
{
    cuda_backend *c = cu(b);
    capture_drop(c);
    cudaStreamSynchronize(c->stream); /* no instance is destroyed while it runs */
    graphs_release(c);
    for (int i = 0; i < GRAPH_SLOTS; i++)
        fitm_cuda_tape_destroy(c->slots[i].tape);
    fitm_cuda_tape_destroy(c->rec);
    release_weights(c);
    free(c->w);
    free(c->host);
    if (c->pin)
        cudaFreeHost(c->pin);
    if (c->dl)
        cudaFreeHost(c->dl);
    free(c->late);
    grow_buf *bufs[] = {&c->tmp_w[0], &c->tmp_w[1],  &c->wf,        &c->xpad,       &c->ypad,
                        &c->ids,      &c->cap_index, &c->cap_spans, &c->iv_spans,   &c->iv_alpha,
                        &c->cap_mass, &c->cap_probs, &c->top,       &c->top_scratch, &c->many,
                        &c->picks,    &c->lp,        &c->kv_rows};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free_buf(bufs[i]);
    free_buf(&c->wb);
    free_buf(&c->xb);
    for (int i = 0; i < c->n_pool; i++)
        cudaFree(c->pool[i].p);
    for (size_t i = 0; i < c->n_live; i++) /* an owner that outlived the backend */
        cudaFree(c->live[i].p);
    free(c->live);
    if (c->blas)
        cublasDestroy(c->blas);
    fitm_cuda_set_pdl(c->stream, false); /* no later stream at its address is programmatic */
    cudaStreamDestroy(c->stream);
    free(c);
}

/* Grows the scratch that depends on the call sizes (token ids, capture row indices) ahead of
 * the first pass. */
static fitm_status cuda_reserve(fitm_backend *b, int64_t max_tokens, int64_t max_keys,
                                int64_t max_k, fitm_err *err)
{
    cuda_backend *c = cu(b);
    (void)max_keys;
    /* xb: the bfloat16 activations of the widest product of a whole call, so that no pass
     * ends its capture to allocate them (grow) */
    if (!grow(c, &c->ids, (size_t)max_tokens * sizeof(int32_t)) ||
        !grow(c, &c->cap_index, (size_t)max_tokens * sizeof(int32_t)) ||
        (c->weights == FITM_CUDA_WEIGHTS_BF16 &&
         !grow(c, &c->xb, (size_t)(max_tokens * max_k) * sizeof(uint16_t)))) {
        const int rc = c->rc;
        c->rc = 0;
        return fitm_cuda_status(rc, err, "CUDA backend: reserve");
    }
    return FITM_OK;
}

/* ---- ops ---------------------------------------------------------------------------------- */

/* x (T, C) = rows ids of the embedding w times scale; the ids are staged. */
static void cuda_embed(fitm_backend *b, const fitm_weight *w, const int32_t *ids, int64_t T,
                       float scale, float *x)
{
    cuda_backend *c = cu(b);
    capture_on(c);
    const void *W = weight_dev(c, w, 0);
    const int32_t *ids_dev = W ? stage(c, &c->ids, ids, (size_t)T * sizeof(int32_t)) : NULL;
    if (ids_dev)
        ok(c,
           fitm_cuda_embed(w->type, W, (int64_t)w->row_bytes, w->n_cols, ids_dev, T, scale, x,
                           c->stream),
           "embed");
}

#define MM_ROWS_PER_LAUNCH 65535

/* Rows of every cuBLAS call of the BATCH class in F32 (gpu_weights = f32). cuBLAS picks its
 * kernel (tiles, split-K) by the shape, so a row of a 7-row call and the same row of a 300-row
 * call could be summed in different orders; every call here has exactly GEMM_ROWS rows (the
 * last chunk zero-padded in scratch), the same N and K, and 256-byte aligned operands, so every
 * chunk runs the same kernel, which reduces K in the same order for each output: a row's result
 * does not depend on T or on where the row falls in it. cuBLAS does not document that promise;
 * the CUDA build's test_backend_cuda checks it on the device (prefix reuse bit-identical to a
 * full pass). 64 rows keep the padding of short calls (reference passes of a few tokens) cheap
 * while the weight, read once per chunk, is reused 64 times. The bfloat16 path needs none of
 * this: its own kernel (fitm_cuda_gemm_bf16) keeps a row's result independent of T by
 * construction and takes every row in one launch. */
#define GEMM_ROWS 64

static bool blas_ok(cuda_backend *c, cublasStatus_t st, const char *what)
{
    if (st == CUBLAS_STATUS_SUCCESS)
        return c->rc == 0;
    char w[96];
    snprintf(w, sizeof w, "%s (%s)", what, cublasGetStatusName(st));
    /* a kernel failing inside cuBLAS leaves its error in the runtime */
    const int rc = (int)cudaGetLastError();
    return ok(c,
              rc                                 ? rc
              : st == CUBLAS_STATUS_ALLOC_FAILED ? (int)cudaErrorMemoryAllocation
                                                 : (int)cudaErrorUnknown,
              w);
}

/* One GEMM_ROWS-row product, column-major view: y^T (N, GEMM_ROWS) = W (K, N)^T . x^T (K,
 * GEMM_ROWS), W and x F32, pedantic F32 compute (no TF32). */
static bool gemm_chunk(cuda_backend *c, const float *W, int64_t N, int64_t K, const float *x,
                       float *y)
{
    const float one = 1.0f, zero = 0.0f;
    return blas_ok(c,
                   cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, GEMM_ROWS, (int)K, &one,
                                W, CUDA_R_32F, (int)K, x, CUDA_R_32F, (int)K, &zero, y, CUDA_R_32F,
                                (int)N, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
                   "matmul (cuBLAS GEMM)");
}

/* y (T, N) = x (T, K) . W^T, W (N, K) F32 on the device, in calls of GEMM_ROWS rows; the tail
 * goes through zero-padded scratch, so every call has the same shape. */
static void gemm_rows(cuda_backend *c, const float *W, int64_t N, int64_t K, const float *x,
                      int64_t T, float *y)
{
    for (int64_t t0 = 0; t0 < T && c->rc == 0; t0 += GEMM_ROWS) {
        const int64_t n = T - t0 < GEMM_ROWS ? T - t0 : GEMM_ROWS;
        const float *xs = x + t0 * K;
        float *ys = y + t0 * N;
        if (n < GEMM_ROWS && !grow(c, &c->ypad, (size_t)(GEMM_ROWS * N) * 4))
            return;
        if (n < GEMM_ROWS) { /* the tail: through zero-padded scratch */
            if (!grow(c, &c->xpad, (size_t)(GEMM_ROWS * K) * 4) ||
                !ok(c,
                    fitm_cuda_copy_async(c->xpad.p, xs, (size_t)(n * K) * 4,
                                         cudaMemcpyDeviceToDevice, c->stream),
                    "matmul padding") ||
                !ok(c,
                    fitm_cuda_memset_async((float *)c->xpad.p + n * K, 0,
                                           (size_t)((GEMM_ROWS - n) * K) * 4, c->stream),
                    "matmul padding"))
                return;
            xs = c->xpad.p;
        }
        if (!gemm_chunk(c, W, N, K, xs, n < GEMM_ROWS ? c->ypad.p : ys))
            return;
        if (n < GEMM_ROWS)
            ok(c,
               fitm_cuda_copy_async(ys, c->ypad.p, (size_t)(n * N) * 4, cudaMemcpyDeviceToDevice,
                                    c->stream),
               "matmul padding");
    }
}

/* The weight w (stored as W on the device) as F32: itself when stored so, else dequantized
 * into the scratch wf. NULL on an error (recorded). */
static const float *weight_f32(cuda_backend *c, const fitm_weight *w, const void *W)
{
    const int64_t N = w->n_rows, K = w->n_cols;
    if (w->type == FITM_DTYPE_F32)
        return W;
    if (!grow(c, &c->wf, (size_t)(N * K) * 4) ||
        !ok(c, fitm_cuda_dequant_f32(w->type, W, c->wf.p, N * K, c->stream), "matmul (dequantize)"))
        return NULL;
    return c->wf.p;
}

/* dst (N, K) = w's values (stored as W on the device) rounded to bfloat16. */
static bool to_bf16(cuda_backend *c, const fitm_weight *w, const void *W, uint16_t *dst)
{
    const float *Wf = weight_f32(c, w, W);
    return Wf && ok(c, fitm_cuda_to_bf16(Wf, w->n_rows, w->n_cols, w->n_rows, dst, c->stream),
                    "matmul (weight to bfloat16)");
}

/* x (T, K) rounded to bfloat16 in the scratch xb: what a BATCH product on the tensor cores
 * multiplies. NULL on an error (recorded). */
static const uint16_t *x_bf16(cuda_backend *c, const float *x, int64_t T, int64_t K)
{
    if (!grow(c, &c->xb, (size_t)(T * K) * sizeof(uint16_t)) ||
        !ok(c, fitm_cuda_to_bf16(x, T, K, T, c->xb.p, c->stream),
            "matmul (activations to bfloat16)"))
        return NULL;
    return c->xb.p;
}

/* The BATCH class. F32: the weight as F32 (weight_f32), then gemm_rows through cuBLAS. BF16:
 * the weight's bfloat16 copy from prepare (a weight without one, as tests hand in, is
 * converted into scratch for the call: the same values), x rounded to bfloat16 (x_bf16), then
 * every row in one launch of fitm_cuda_gemm_bf16. */
static void matmul_batched(cuda_backend *c, const fitm_weight *w, const void *W, const float *x,
                           int64_t T, float *y)
{
    const int64_t N = w->n_rows, K = w->n_cols;
    if (c->weights == FITM_CUDA_WEIGHTS_BF16) {
        const dev_weight *d = find_weight(c, w->data);
        const uint16_t *Wb = d ? d->bf16 : NULL;
        if (!Wb) {
            if (!grow(c, &c->wb, (size_t)(N * K) * sizeof(uint16_t)) || !to_bf16(c, w, W, c->wb.p))
                return;
            Wb = c->wb.p;
        }
        const uint16_t *xb = x_bf16(c, x, T, K);
        if (xb)
            ok(c, fitm_cuda_gemm_bf16(1, &Wb, &N, K, xb, T, &y, c->stream),
               "matmul (bfloat16 GEMM)");
        return;
    }
    const float *Wf = weight_f32(c, w, W);
    if (Wf)
        gemm_rows(c, Wf, N, K, x, T, y);
}

/* The BATCH products of outs (without their biases) as one launch of fitm_cuda_gemm_bf16, when
 * the products are bfloat16, there are several (a layer's Q, K and V; gate and up), fusion is
 * on and every weight has its bfloat16 copy: output i is computed as its own launch computes
 * it. False: nothing launched. */
static bool batch_outs_fused(cuda_backend *c, const float *x, int64_t T, const fitm_mm_out *outs,
                             int n_outs)
{
    if (c->weights != FITM_CUDA_WEIGHTS_BF16 || !c->fuse || n_outs < 2 ||
        n_outs > FITM_CUDA_MM_MAX_OUTS)
        return false;
    const uint16_t *W[FITM_CUDA_MM_MAX_OUTS];
    int64_t N[FITM_CUDA_MM_MAX_OUTS];
    float *y[FITM_CUDA_MM_MAX_OUTS];
    for (int i = 0; i < n_outs; i++) {
        const dev_weight *d = find_weight(c, outs[i].w->data);
        if (!d || !d->bf16 || outs[i].w->n_cols != outs[0].w->n_cols)
            return false;
        W[i] = d->bf16, N[i] = outs[i].w->n_rows, y[i] = outs[i].y;
    }
    const int64_t K = outs[0].w->n_cols;
    const uint16_t *xb = x_bf16(c, x, T, K);
    if (xb)
        ok(c, fitm_cuda_gemm_bf16(n_outs, W, N, K, xb, T, y, c->stream), "matmul (bfloat16 GEMM)");
    return true;
}

/* The STEP products of outs (without their biases) as one launch, when there are several
 * (a layer's Q, K and V), fusion is on, and their weights are resident and of one type
 * (fitm_cuda_matmul_rows_n: the bits of one launch each). False: nothing launched. */
static bool step_outs_fused(cuda_backend *c, const float *x, int64_t T, const fitm_mm_out *outs,
                            int n_outs)
{
    if (!c->fuse || n_outs < 2 || n_outs > FITM_CUDA_MM_MAX_OUTS)
        return false;
    const void *W[FITM_CUDA_MM_MAX_OUTS];
    int64_t N[FITM_CUDA_MM_MAX_OUTS];
    float *y[FITM_CUDA_MM_MAX_OUTS];
    for (int i = 0; i < n_outs; i++) {
        const dev_weight *d = find_weight(c, outs[i].w->data);
        if (!d || outs[i].w->type != outs[0].w->type || outs[i].w->n_cols != outs[0].w->n_cols)
            return false;
        W[i] = d->dev, N[i] = outs[i].w->n_rows, y[i] = outs[i].y;
    }
    const fitm_weight *w = outs[0].w;
    for (int64_t t0 = 0; t0 < T && c->rc == 0; t0 += MM_ROWS_PER_LAUNCH) {
        const int64_t n = T - t0 < MM_ROWS_PER_LAUNCH ? T - t0 : MM_ROWS_PER_LAUNCH;
        float *yt[FITM_CUDA_MM_MAX_OUTS];
        for (int i = 0; i < n_outs; i++)
            yt[i] = y[i] + t0 * N[i];
        ok(c,
           fitm_cuda_matmul_rows_n(w->type, n_outs, W, N, w->n_cols, x + t0 * w->n_cols, n, yt,
                                   c->stream),
           "matmul");
    }
    return true;
}

/* Each outs[i].y (T, N) = x (T, K) . W^T (+ bias): the BATCH class through the bfloat16 GEMM
 * kernel (captured like any launch) or, with F32 products, cuBLAS (not captured); the STEP
 * class through the warp-per-output kernel. */
static void cuda_matmul(fitm_backend *b, const float *x, int64_t T, const fitm_mm_out *outs,
                        int n_outs, bool batched)
{
    cuda_backend *c = cu(b);
    if (batched && c->weights != FITM_CUDA_WEIGHTS_BF16)
        capture_off(c);
    else
        capture_on(c);
    const bool one_launch =
        batched ? batch_outs_fused(c, x, T, outs, n_outs) : step_outs_fused(c, x, T, outs, n_outs);
    for (int i = 0; i < n_outs && c->rc == 0; i++) {
        const fitm_weight *w = outs[i].w;
        const int64_t N = w->n_rows, K = w->n_cols;
        const void *W = one_launch ? NULL : weight_dev(c, w, 0);
        if (W && batched)
            matmul_batched(c, w, W, x, T, outs[i].y);
        for (int64_t t0 = 0; W && !batched && t0 < T && c->rc == 0; t0 += MM_ROWS_PER_LAUNCH) {
            const int64_t n = T - t0 < MM_ROWS_PER_LAUNCH ? T - t0 : MM_ROWS_PER_LAUNCH;
            ok(c,
               fitm_cuda_matmul_rows(w->type, W, N, K, x + t0 * K, n, outs[i].y + t0 * N,
                                     c->stream),
               "matmul");
        }
        if (outs[i].bias) {
            const void *bias = weight_dev(c, outs[i].bias, 1);
            if (bias)
                ok(c, fitm_cuda_add_rows(outs[i].y, bias, T, N, c->stream), "bias");
        }
    }
}

static void norm_flush(cuda_backend *c);

/* Whether na floats at a and nb floats at b have no element in common. */
static bool apart(const float *a, int64_t na, const float *b, int64_t nb)
{
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x + (uintptr_t)na * sizeof(float) <= y || y + (uintptr_t)nb * sizeof(float) <= x;
}

/* The row of the pending add's sum (rows of n floats) at which x starts, when x and the rows
 * after it that a norm of rows rows reads all lie in that sum; else -1. */
static int64_t row_in_sum(const cuda_backend *c, const float *x, int64_t rows, int64_t n)
{
    const uintptr_t at = (uintptr_t)x, sum = (uintptr_t)c->add.y;
    const uintptr_t row = (uintptr_t)n * sizeof(float);
    if (c->add.n == 0 || n <= 0 || at < sum || (at - sum) % row != 0)
        return -1;
    const int64_t r0 = (int64_t)((at - sum) / row);
    return r0 + rows <= c->add.n / n ? r0 : -1;
}

/* y (rows, n) = rmsnorm(x) * w; w must be F32. When the pending add writes exactly x, both
 * run as one kernel (the same values bit for bit: fitm_cuda_add_rmsnorm). When the pending
 * add adds the pending rmsnorm's output (a block's post-norm) and x is rows of its sum (all
 * of them between layers; a prompt's last row, or a step's rows of every sequence, for the
 * final norm), all three (fitm_cuda_norm_add_rmsnorm). With fusion on, a norm that fuses with
 * nothing before it is kept pending itself where its weight is resident (a weight copied for
 * one call sits in scratch that a later op's copy may overwrite). */
static void cuda_rmsnorm(fitm_backend *b, float *y, const float *x, const fitm_weight *w,
                         int64_t rows, int64_t n, float eps)
{
    cuda_backend *c = cu(b);
    const int64_t len = rows * n, all = c->add.n, y0 = row_in_sum(c, x, rows, n);
    const bool three = c->norm.rows > 0 && y0 >= 0 && c->norm.n == n && c->norm.eps == eps &&
                       (y == x || (apart(y, len, c->norm.x, all) &&
                                   apart(y, len, c->norm.y, all) && apart(y, len, c->add.y, all)));
    if (!three)
        norm_flush(c); /* before the pending add, which may add its output */
    const bool fuse = three || (c->add.n > 0 && c->add.y == x && c->add.n == len);
    float *sum = c->add.y;
    const float *res = c->add.x;
    float *post = c->norm.y;
    const float *o = c->norm.x;
    const void *w_post = c->norm.w;
    const int64_t T = c->norm.rows;
    if (fuse)
        c->add.n = 0;
    c->norm.rows = 0; /* launched above unless fused */
    capture_on(c); /* launches a pending add that is not fused */
    if (w->type != FITM_DTYPE_F32) {
        ok(c, (int)cudaErrorInvalidValue, "rmsnorm weight is not F32");
        return;
    }
    const dev_weight *d = find_weight(c, w->data);
    const bool resident = d != NULL;
    const void *wd = resident ? d->dev : weight_dev(c, w, 1);
    if (!wd || c->rc)
        return;
    if (three)
        ok(c,
           fitm_cuda_norm_add_rmsnorm(post, o, w_post, sum, y, wd, 0.0f, T, y0, rows, n, eps,
                                      c->stream),
           "rmsnorm + add + rmsnorm");
    else if (fuse)
        ok(c, fitm_cuda_add_rmsnorm(y, sum, res, wd, 0.0f, rows, n, eps, c->stream),
           "add + rmsnorm");
    else if (c->fuse && resident && len > 0) {
        c->norm.y = y;
        c->norm.x = x;
        c->norm.w = wd;
        c->norm.rows = rows;
        c->norm.n = n;
        c->norm.eps = eps;
    } else
        ok(c, fitm_cuda_rmsnorm(y, x, wd, 0.0f, rows, n, eps, c->stream), "rmsnorm");
}

/* A layer's query and key heads, in place: per-head norms where given, then RoPE, as one
 * kernel (fitm_cuda_qk_norm_rope: the values of the rmsnorm and rope ops). */
static void cuda_qk_rope(fitm_backend *b, float *q, float *k, int64_t T, int64_t H, int64_t Hkv,
                         int64_t D, int64_t n_rot, const float *cs, bool neox,
                         const fitm_weight *q_norm, const fitm_weight *k_norm, float eps)
{
    cuda_backend *c = cu(b);
    capture_on(c);
    if ((q_norm && q_norm->type != FITM_DTYPE_F32) || (k_norm && k_norm->type != FITM_DTYPE_F32)) {
        ok(c, (int)cudaErrorInvalidValue, "rmsnorm weight is not F32");
        return;
    }
    const void *qw = q_norm ? weight_dev(c, q_norm, 0) : NULL;
    const void *kw = k_norm ? weight_dev(c, k_norm, 1) : NULL;
    if (c->rc == 0 && (qw || !q_norm) && (kw || !k_norm))
        ok(c,
           fitm_cuda_qk_norm_rope(q, k, qw, kw, 0.0f, T, H, Hkv, D, n_rot, cs, neox, eps,
                                  c->stream),
           "qk norm + rope");
}

/* RoPE in place on x (T, n_heads, D) with the driver's table cs (device memory). */
static void cuda_rope(fitm_backend *b, float *x, int64_t T, int64_t n_heads, int64_t D,
                      int64_t n_rot, const float *cs, bool neox)
{
    cuda_backend *c = cu(b);
    capture_on(c);
    if (c->rc == 0)
        ok(c, fitm_cuda_rope_table(x, T, n_heads, D, n_rot, cs, neox, c->stream), "rope");
}

/* y (n) = act(g) * u. */
static void cuda_glu(fitm_backend *b, float *y, const float *g, const float *u, int64_t n,
                     fitm_act act)
{
    cuda_backend *c = cu(b);
    capture_on(c);
    if (c->rc == 0)
        ok(c,
           act == FITM_ACT_GELU ? fitm_cuda_geglu(y, g, u, n, c->stream)
                                : fitm_cuda_swiglu(y, g, u, n, c->stream),
           "glu");
}

/* A decode step's gate and up products and the GLU as one kernel where both weights have one
 * type and shape (fitm_cuda_matmul_glu: the values of the three launches), else as those. */
static void cuda_matmul_glu(fitm_backend *b, const float *x, int64_t T, const fitm_mm_out gu[2],
                            fitm_act act)
{
    cuda_backend *c = cu(b);
    const fitm_weight *wg = gu[0].w, *wu = gu[1].w;
    if (wg->type != wu->type || wg->n_rows != wu->n_rows || wg->n_cols != wu->n_cols ||
        gu[0].bias || gu[1].bias) {
        cuda_matmul(b, x, T, gu, 2, false);
        cuda_glu(b, gu[0].y, gu[0].y, gu[1].y, T * wg->n_rows, act);
        return;
    }
    capture_on(c);
    const int64_t N = wg->n_rows, K = wg->n_cols;
    const void *G = weight_dev(c, wg, 0);
    const void *U = G ? weight_dev(c, wu, 1) : NULL;
    for (int64_t t0 = 0; U && t0 < T && c->rc == 0; t0 += MM_ROWS_PER_LAUNCH) {
        const int64_t n = T - t0 < MM_ROWS_PER_LAUNCH ? T - t0 : MM_ROWS_PER_LAUNCH;
        ok(c,
           fitm_cuda_matmul_glu(wg->type, G, U, N, K, x + t0 * K, n, act == FITM_ACT_GELU,
                                gu[0].y + t0 * N, c->stream),
           "matmul + glu");
    }
}

/* Launches the pending rmsnorm, if any. */
static void norm_flush(cuda_backend *c)
{
    const int64_t rows = c->norm.rows;
    c->norm.rows = 0;
    if (rows > 0 && c->rc == 0)
        ok(c,
           fitm_cuda_rmsnorm(c->norm.y, c->norm.x, c->norm.w, 0.0f, rows, c->norm.n, c->norm.eps,
                             c->stream),
           "rmsnorm");
}

/* Launches the pending work in the order it was asked for: the KV stores (never pending
 * beside the others: they are kept after this flush, and any op after them flushes them
 * first), the rmsnorm, then the add. */
static void pending_flush(cuda_backend *c)
{
    const int kv_n = c->kv.n;
    c->kv.n = 0;
    if (kv_n > 0 && c->rc == 0 &&
        stage_at(c, c->kv_rows.p, c->kv.k, (size_t)kv_n * sizeof(fitm_cuda_kv_rows)))
        ok(c, fitm_cuda_kv_store_many(c->kv.k, c->kv_rows.p, kv_n, c->stream), "KV store");
    norm_flush(c);
    const int64_t n = c->add.n;
    c->add.n = 0;
    if (n > 0 && c->rc == 0)
        ok(c, fitm_cuda_add(c->add.y, c->add.x, n, c->stream), "add");
}

/* y (n) += x (n): kept pending, so that a following rmsnorm of y runs both in one launch
 * (the forward driver's residual add, then the next block's norm), and with the pending
 * rmsnorm whose output it adds where there is one (the block's post-norm: three ops in one
 * launch); any other op launches it first. */
static void cuda_add(fitm_backend *b, float *y, const float *x, int64_t n)
{
    cuda_backend *c = cu(b);
    /* the sum must not touch the norm's input or output, which the fused kernel reads */
    const bool after_norm = c->norm.rows > 0 && c->add.n == 0 && x == c->norm.y &&
                            n == c->norm.rows * c->norm.n && apart(y, n, c->norm.x, n) &&
                            apart(y, n, c->norm.y, n);
    if (!after_norm)
        capture_on(c); /* launches earlier pending work */
    if (c->rc == 0 && n > 0) {
        c->add.y = y;
        c->add.x = x;
        c->add.n = n;
        if (!c->fuse)
            pending_flush(c);
    }
}

/* x (n) = cap * tanh(x / cap). */
static void cuda_softcap(fitm_backend *b, float *x, int64_t n, float cap)
{
    cuda_backend *c = cu(b);
    capture_on(c);
    if (c->rc == 0)
        ok(c, fitm_cuda_softcap(x, n, cap, c->stream), "softcap");
}

/* Makes the host scratch at least bytes long. */
static bool grow_host(cuda_backend *c, size_t bytes, const char *what)
{
    if (c->host_cap >= bytes)
        return true;
    void *h = realloc(c->host, bytes);
    if (!h)
        return ok(c, (int)cudaErrorMemoryAllocation, what);
    c->host = h;
    c->host_cap = bytes;
    return true;
}

/* The selection on the device and one copy of rows * k (value, index) pairs: 512 bytes per
 * row for the sampler's 64 candidates, where the whole row is 1 MiB for Gemma 3. */
static void cuda_topk(fitm_backend *b, const float *x, int64_t rows, int64_t n, int32_t k,
                      fitm_top *top)
{
    cuda_backend *c = cu(b);
    const size_t pairs = (size_t)(rows * k), bytes = pairs * (sizeof(float) + sizeof(int32_t));
    capture_on(c);
    if (c->rc || rows == 0 || !grow(c, &c->top, bytes) ||
        !grow(c, &c->top_scratch, fitm_cuda_topk_scratch(rows, n, k) + 1))
        return;
    if (!grow_host(c, bytes, "host buffer for the top logits"))
        return;
    float *val = c->top.p;
    int32_t *id = (int32_t *)((char *)c->top.p + pairs * sizeof(float));
    if (!ok(c, fitm_cuda_topk(x, rows, n, n, k, c->top_scratch.p, val, id, c->stream), "topk") ||
        !to_host(c, c->host, c->top.p, bytes, "top logits download"))
        return;
    const float *hv = c->host;
    const int32_t *hi = (const int32_t *)((const char *)c->host + pairs * sizeof(float));
    for (size_t i = 0; i < pairs; i++)
        top[i] = (fitm_top){hv[i], hi[i]};
}

_Static_assert(FITM_PICK_MAX <= FITM_CUDA_PICK_MAX, "the driver's picks fit the kernel's");

/* The rows' log-probabilities on the device (kernels/logprob.cu, one block per row) and one
 * copy of rows * n_pick doubles: 8 bytes per query-likelihood row where the row is 1 MiB for
 * Gemma 3. The picks go up through the staging area; the values come down into lp at once
 * (no unpacking, so no host scratch). */
static void cuda_logprob(fitm_backend *b, const float *x, int64_t rows, int64_t n,
                         const int32_t *pick, int32_t n_pick, double *lp)
{
    cuda_backend *c = cu(b);
    const size_t vals = (size_t)(rows * n_pick);
    capture_on(c);
    if (c->rc || rows == 0 || !grow(c, &c->lp, vals * sizeof(double)))
        return;
    const int32_t *dpick = stage(c, &c->picks, pick, vals * sizeof(int32_t));
    if (!dpick ||
        !ok(c, fitm_cuda_logprob(x, rows, n, dpick, n_pick, c->lp.p, c->stream), "logprob"))
        return;
    to_host(c, lp, c->lp.p, vals * sizeof(double), "log-probabilities download");
}

#define DL_MIN_FLOATS ((size_t)1 << 18)

/* n floats at the device address src into dst (or added onto it, add: the passes of Attention
 * Buckets summed in the caller's arrays; the keys a row does not see are 0 on the device, so
 * adding every entry adds what the CPU backend adds) at the next wait, not
 * now: the copy goes on the stream into the pinned area dl (capturable, so a pass's captured
 * rows ride in its graph) and late_flush moves it to dst once the stream is done. The caller's
 * arrays of a forward call are read only after the call's status, which waits; a pass with
 * captures thus waits once, where a download per captured row and layer waited each time. An
 * area too small for what is pending waits first (and grows, nothing being in flight then). */
static bool fetch_late(cuda_backend *c, float *dst, const float *src, int64_t n, bool add)
{
    const size_t bytes = (size_t)n * sizeof(float), need = align64(bytes) / sizeof(float);
    if (n == 0 || c->rc)
        return c->rc == 0;
    if (c->dl_used + need > c->dl_cap) {
        /* every copy into the area done and delivered (a failed pass's too) before reuse;
         * and no capture under way where the area is allocated */
        if (!(c->dl ? sync_stream(c, "capture download") : capture_off(c)))
            return false;
        if (need > c->dl_cap) { /* empty now, and still too small */
            size_t cap = need > 2 * c->dl_cap ? need : 2 * c->dl_cap;
            cap = cap > DL_MIN_FLOATS ? cap : DL_MIN_FLOATS;
            if (c->dl)
                cudaFreeHost(c->dl);
            c->dl = NULL;
            c->dl_cap = 0;
            if (!ok(c, (int)cudaMallocHost((void **)&c->dl, cap * sizeof(float)),
                    "pinned download allocation"))
                return false;
            c->dl_cap = cap;
        }
    }
    if (c->n_late == c->late_cap) {
        const size_t lc = c->late_cap ? 2 * c->late_cap : 64;
        late_copy *l = realloc(c->late, lc * sizeof *l);
        if (!l)
            return ok(c, (int)cudaErrorMemoryAllocation, "capture download list");
        c->late = l;
        c->late_cap = lc;
    }
    capture_on(c);
    if (!ok(c,
            fitm_cuda_copy_async(c->dl + c->dl_used, src, bytes, cudaMemcpyDeviceToHost, c->stream),
            "capture download"))
        return false;
    c->late[c->n_late++] = (late_copy){dst, c->dl_used, n, add};
    c->dl_used += need;
    return true;
}

/* Copies (or adds) the captured rows of this call from the device buffers to the caller's
 * arrays, at the next wait (fetch_late). */
static void download_capture(cuda_backend *c, const fitm_attn_args *a)
{
    const fitm_capture *cap = a->capture;
    const int64_t H = a->n_head;
    for (int64_t i = 0; i < a->T && c->rc == 0; i++) {
        const int32_t r = a->cap_index[i];
        if (r < 0)
            continue;
        const int64_t slot = ((int64_t)r * a->n_layer + a->layer) * H;
        if (cap->span_mass && cap->n_spans > 0)
            fetch_late(c, cap->span_mass + slot * cap->n_spans,
                       (float *)c->cap_mass.p + (int64_t)r * H * cap->n_spans, H * cap->n_spans,
                       cap->add);
        if (cap->probs)
            fetch_late(c, cap->probs + slot * cap->probs_stride,
                       (float *)c->cap_probs.p + (int64_t)r * H * cap->probs_stride,
                       H * cap->probs_stride, cap->add);
    }
}

/* The kernel's arguments for a, but for the capture and the intervention, whose host arrays
 * the caller stages. */
static fitm_cuda_attn attn_kernel_args(const fitm_attn_args *a)
{
    fitm_cuda_attn k = {
        .T = a->T,
        .pos0 = a->pos0,
        .own_base = a->own_base,
        .window = a->window,
        .n_head = a->n_head,
        .n_head_kv = a->n_head_kv,
        .head_dim = a->head_dim,
        .scale = a->scale,
        .q = a->q,
        .out = a->out,
        .k_pre = a->k_pre, /* F32 caches only (no ops->kv_half) */
        .v_pre = a->v_pre,
        .k_own = a->k_own,
        .v_own = a->v_own,
    };
    if (a->mix) { /* every array is device memory (forward.c allocates them on the backend) */
        k.mix_n = a->mix->n_mix;
        k.mix_k_heads = a->mix->k_heads;
        k.mix_q = a->mix->q;
        k.mix_k = a->mix->k;
        k.mix_w = a->mix->w;
        k.mix_k_stride = a->mix->k_stride;
    }
    return k;
}

/* Whether row i of the call a is plain: not captured, not intervened, no mixture. */
static bool attn_row_plain(const fitm_attn_args *a, int64_t i)
{
    const fitm_capture *cap = a->capture;
    const fitm_intervention *iv = a->intervention;
    return !a->mix && !(cap && cap->n_rows > 0 && a->cap_index[i] >= 0) &&
           !(iv && iv->n_spans > 0 && a->pos0 + i >= iv->from_pos);
}

/* The first run of plain rows from row i on that fills a tiled block (at least min rows),
 * as [*s, *e); *s = T when there is none. */
static void attn_plain_run(const fitm_attn_args *a, int64_t i, int64_t min, int64_t *s,
                           int64_t *e)
{
    int64_t at = i;
    while (at < a->T) {
        int64_t run = at, end;
        while (run < a->T && !attn_row_plain(a, run))
            run++;
        for (end = run; end < a->T && attn_row_plain(a, end);)
            end++;
        if (end - run >= min) {
            *s = run, *e = end;
            return;
        }
        at = end;
    }
    *s = *e = a->T;
}

/* Whether the call a's plain rows go to the tensor-core kernel (fitm_cuda_attention_bf16): a
 * batched call with gpu_weights = bf16. Then every plain row of such a call does, however
 * short its run, since that kernel's bits are its own. */
static bool attn_bf16(const cuda_backend *c, const fitm_attn_args *a)
{
    return a->batched && c->weights == FITM_CUDA_WEIGHTS_BF16;
}

/* The fewest consecutive plain rows of the call a that go to a kernel for plain rows. */
static int64_t attn_plain_min(const cuda_backend *c, const fitm_attn_args *a)
{
    return attn_bf16(c, a) ? 1 : fitm_cuda_attention_tile_rows(a->n_head, a->n_head_kv);
}

/* The kernels for the call a (arguments k): each run of plain rows to the tensor-core kernel
 * (attn_bf16), or when long enough for a tiled block to fitm_cuda_attention_tiled, the rows
 * between to fitm_cuda_attention_rows. A captured or intervened suffix (a /rerank pass's
 * query rows, an /answer's rows after its documents) makes two launches; a call with a
 * mixture, or too short, one launch of the one-row kernel. */
static bool attention_launch(cuda_backend *c, const fitm_attn_args *a, const fitm_cuda_attn *k)
{
    const bool bf16 = attn_bf16(c, a);
    const int64_t min = attn_plain_min(c, a);
    fitm_cuda_attn kt = *k; /* the tiled rows' arguments: their capture is no part of them */
    kt.cap_index = NULL;
    kt.cap_spans = NULL;
    kt.cap_n_spans = 0;
    kt.cap_mass = kt.cap_probs = NULL;
    kt.cap_probs_stride = 0;
    for (int64_t i = 0; i < a->T;) {
        int64_t s = a->T, e = a->T;
        if (min > 0)
            attn_plain_run(a, i, min, &s, &e);
        if (s > i && !ok(c, fitm_cuda_attention_rows(k, i, s, c->stream), "attention"))
            return false;
        if (e > s && !ok(c,
                         bf16 ? fitm_cuda_attention_bf16(&kt, s, e, c->stream)
                              : fitm_cuda_attention_tiled(&kt, s, e, c->stream),
                         "attention"))
            return false;
        i = e;
    }
    return true;
}

static bool attn_tiles(const cuda_backend *c, const fitm_attn_args *a);

static void attention_staged(cuda_backend *c, const fitm_attn_args *a, int n);

/* One call's attention (backend.h); its captured rows reach the caller's arrays at the next
 * wait (download_capture). A call without captured rows or rows for the tiled kernel (a
 * decode step's) goes through the staged arguments of attention_staged: its kernel argument
 * is then the same device address at every step, and what changes from step to step (key
 * counts, positions) is staged bytes, so that consecutive steps' work can equal an
 * instance's tape (replay_end). */
static void cuda_attention(fitm_backend *b, const fitm_attn_args *a)
{
    cuda_backend *c = cu(b);
    if (!(a->capture && a->capture->n_rows > 0) && !attn_tiles(c, a)) {
        attention_staged(c, a, 1);
        return;
    }
    capture_on(c);
    if (c->rc)
        return;
    fitm_cuda_attn k = attn_kernel_args(a);
    const fitm_capture *cap = a->capture;
    if (cap && cap->n_rows > 0) {
        k.cap_index = stage(c, &c->cap_index, a->cap_index, (size_t)a->T * sizeof(int32_t));
        k.cap_after = cap->after_intervention;
        if (cap->span_mass && cap->n_spans > 0) {
            k.cap_spans = stage(c, &c->cap_spans, cap->spans, (size_t)cap->n_spans * 16);
            k.cap_n_spans = cap->n_spans;
            if (grow(c, &c->cap_mass,
                     (size_t)cap->n_rows * (size_t)a->n_head * (size_t)cap->n_spans * 4))
                k.cap_mass = c->cap_mass.p;
        }
        if (cap->probs &&
            grow(c, &c->cap_probs,
                 (size_t)cap->n_rows * (size_t)a->n_head * (size_t)cap->probs_stride * 4)) {
            k.cap_probs = c->cap_probs.p;
            k.cap_probs_stride = cap->probs_stride;
        }
    }
    const fitm_intervention *iv = a->intervention;
    if (iv && iv->n_spans > 0) {
        k.iv_spans = stage(c, &c->iv_spans, iv->spans, (size_t)iv->n_spans * 16);
        k.iv_alpha = stage(c, &c->iv_alpha, iv->alpha, (size_t)iv->n_spans * sizeof(float));
        k.iv_n_spans = iv->n_spans;
        k.iv_from_pos = iv->from_pos;
    }
    if (c->rc || !attention_launch(c, a, &k))
        return;
    if (k.cap_index)
        download_capture(c, a);
}

#define ATTN_MANY_MAX 64

/* The device address off bytes into buffer g. */
static void *buf_at(const grow_buf *g, size_t off)
{
    return (char *)g->p + off;
}

/* Whether the call a has a run of plain rows for the tiled or the tensor-core kernel (a prompt
 * chunk). */
static bool attn_tiles(const cuda_backend *c, const fitm_attn_args *a)
{
    const int64_t min = attn_plain_min(c, a);
    int64_t s, e;
    if (min <= 0)
        return false;
    attn_plain_run(a, 0, min, &s, &e);
    return s < a->T;
}

/* A step's sequences as one launch (fitm_cuda_attention_many), their intervention arrays and
 * the kernel arguments staged side by side in one device buffer. Calls with a capture
 * (prefill and /rerank passes: their rows are copied out per call) go one by one, as do more
 * calls than one launch stages or calls of different head counts; so do prompt chunks with
 * rows for the tiled kernel, while the step's decode rows stay in the one launch. */
static void cuda_attention_many(fitm_backend *b, const fitm_attn_args *a, int n)
{
    cuda_backend *c = cu(b);
    bool together = n <= ATTN_MANY_MAX;
    for (int s = 0; s < n && together; s++)
        together = !(a[s].capture && a[s].capture->n_rows > 0) && a[s].n_head == a[0].n_head;
    if (!together) {
        for (int s = 0; s < n; s++)
            cuda_attention(b, &a[s]);
        return;
    }
    fitm_attn_args rest[ATTN_MANY_MAX];
    int n_rest = 0;
    for (int s = 0; s < n; s++) {
        if (attn_tiles(c, &a[s]))
            cuda_attention(b, &a[s]);
        else
            rest[n_rest++] = a[s];
    }
    if (n_rest < n) {
        if (n_rest > 0)
            cuda_attention_many(b, rest, n_rest);
        return;
    }
    attention_staged(c, a, n);
}

/* Whether the pending KV stores are the calls a[0..n)'s own, store s call s's new rows
 * (F32 rows pos0 - own_base .. of its own cache, T of them): the attention launch then does
 * them and reads those rows from the stores' sources instead (k_new), since its blocks run in
 * no order. */
static bool kv_stores_fit(const cuda_backend *c, const fitm_attn_args *a, int n)
{
    if (c->kv.n != n)
        return false;
    for (int s = 0; s < n; s++) {
        const fitm_cuda_kv_rows *r = &c->kv.k[s];
        const int64_t HkvD = (int64_t)a[s].n_head_kv * a[s].head_dim;
        const int64_t at = (a[s].pos0 - a[s].own_base) * HkvD;
        if (r->half || a[s].kv_half || at < 0 || r->n != a[s].T * HkvD ||
            r->k_dst != (const float *)a[s].k_own + at ||
            r->v_dst != (const float *)a[s].v_own + at)
            return false;
    }
    return true;
}

/* The n (1 to ATTN_MANY_MAX) calls a, without captured rows, as one launch of
 * fitm_cuda_attention_many: their intervention arrays and kernel arguments staged side by
 * side in one device buffer. */
static void attention_staged(cuda_backend *c, const fitm_attn_args *a, int n)
{
    /* the pending KV stores ride along when they are these calls' new rows */
    const int kv_n = kv_stores_fit(c, a, n) ? n : 0;
    c->kv.n -= kv_n; /* taken: capture_on does not launch them */
    capture_on(c);
    if (c->rc)
        return;
    fitm_cuda_attn k[ATTN_MANY_MAX];
    size_t at[ATTN_MANY_MAX], total = 0;
    for (int s = 0; s < n; s++) {
        k[s] = attn_kernel_args(&a[s]);
        if (kv_n > 0) {
            k[s].new_base = a[s].pos0;
            k[s].k_new = c->kv.k[s].k;
            k[s].v_new = c->kv.k[s].v;
        }
        at[s] = total;
        const fitm_intervention *iv = a[s].intervention;
        if (iv && iv->n_spans > 0)
            total += align64((size_t)iv->n_spans * 16) + align64((size_t)iv->n_spans * 4);
    }
    const size_t args_at = total, args_bytes = (size_t)n * sizeof(fitm_cuda_attn);
    const size_t kv_bytes = (size_t)kv_n * sizeof(fitm_cuda_kv_rows);
    total += args_bytes + kv_bytes;
    if (!grow(c, &c->many, total))
        return;
    for (int s = 0; s < n; s++) {
        const fitm_intervention *iv = a[s].intervention;
        if (!iv || iv->n_spans <= 0)
            continue;
        const size_t spans = (size_t)iv->n_spans * 16;
        int64_t *iv_spans = buf_at(&c->many, at[s]);
        float *iv_alpha = buf_at(&c->many, at[s] + align64(spans));
        k[s].iv_spans = iv_spans;
        k[s].iv_alpha = iv_alpha;
        k[s].iv_n_spans = iv->n_spans;
        k[s].iv_from_pos = iv->from_pos;
        if (!stage_at(c, iv_spans, iv->spans, spans) ||
            !stage_at(c, iv_alpha, iv->alpha, (size_t)iv->n_spans * sizeof(float)))
            return;
    }
    /* the arguments and the stores' descriptors after them: one copy */
    uint8_t host[ATTN_MANY_MAX * sizeof(fitm_cuda_attn) +
                 FITM_CUDA_KV_ROWS_MAX * sizeof(fitm_cuda_kv_rows)];
    memcpy(host, k, args_bytes);
    memcpy(host + args_bytes, c->kv.k, kv_bytes);
    fitm_cuda_attn *k_dev = buf_at(&c->many, args_at);
    const fitm_cuda_kv_rows *kv_dev = buf_at(&c->many, args_at + args_bytes);
    if (stage_at(c, k_dev, host, args_bytes + kv_bytes))
        ok(c, fitm_cuda_attention_many(k, k_dev, n, c->kv.k, kv_dev, kv_n, c->stream),
           "attention");
}

/* The pass's first error (after waiting for its work), cleared unless the device is lost. */
static fitm_status cuda_status(fitm_backend *b, fitm_err *err)
{
    cuda_backend *c = cu(b);
    if (c->rc == 0 && c->busy) /* errors inside kernels surface here */
        sync_stream(c, "a kernel");
    if (c->rc == 0)
        return FITM_OK;
    char what[160];
    snprintf(what, sizeof what, "CUDA backend: %s%s", c->what[0] ? c->what : "stream",
             c->sticky ? " (device lost: restart the service)" : "");
    fitm_status s = fitm_cuda_status(c->rc, err, what);
    capture_drop(c); /* the failed pass's captured work, if it failed mid-capture */
    c->add.n = 0;    /* and its pending add, norm and KV stores */
    c->norm.rows = 0;
    c->kv.n = 0;
    late_drop(c);    /* and the captured rows it was to deliver */
    if (!c->sticky) {
        c->rc = 0, c->what[0] = 0;
        /* an error a replayed graph left (not returned by a launch) must not fail the next */
        (void)cudaGetLastError();
    }
    return s;
}

static const fitm_backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .reserve = cuda_reserve,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .copy = cuda_copy,
    .kv_store_many = cuda_kv_store_many,
    .prepare = cuda_prepare,
    .status = cuda_status,
    .embed = cuda_embed,
    .matmul = cuda_matmul,
    .rmsnorm = cuda_rmsnorm,
    .rope = cuda_rope,
    .glu = cuda_glu,
    .add = cuda_add,
    .softcap = cuda_softcap,
    .topk = cuda_topk,
    .logprob = cuda_logprob,
    .attention = cuda_attention,
    .attention_many = cuda_attention_many,
    .qk_rope = cuda_qk_rope,
    .matmul_glu = cuda_matmul_glu,
    .attention_mix = true,
    .capture_add = true,
};

void fitm_backend_cuda_set_fusion(fitm_backend *b, bool on)
{
    cuda_backend *c = cu(b);
    pending_flush(c);
    c->fuse = on;
    /* without the fused slots the driver runs the ops they replace one by one */
    c->ops = cuda_ops;
    if (!on) {
        c->ops.qk_rope = NULL;
        c->ops.matmul_glu = NULL;
        c->ops.kv_store_many = NULL;
    }
    c->base.ops = &c->ops;
}

fitm_status fitm_backend_cuda_create(fitm_backend **out, int device, fitm_err *err)
{
    *out = NULL;
    if (fitm_cuda_device_count() <= device)
        return fitm_err_set(err, FITM_ERR_BACKEND, "no CUDA device %d (found %d)", device,
                            fitm_cuda_device_count());
    int rc = (int)cudaSetDevice(device);
    if (rc != 0)
        return fitm_cuda_status(rc, err, "CUDA backend: selecting the device");
    cuda_backend *c = calloc(1, sizeof *c);
    if (!c)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the CUDA backend");
    c->ops = cuda_ops;
    c->base.ops = &c->ops;
    c->graphs = true;
    c->weights = FITM_CUDA_WEIGHTS_BF16;
    c->fuse = true;
    bool tapes = (c->rec = fitm_cuda_tape_create()) != NULL;
    for (int i = 0; i < GRAPH_SLOTS && tapes; i++)
        tapes = (c->slots[i].tape = fitm_cuda_tape_create()) != NULL;
    rc = tapes ? (int)cudaStreamCreate(&c->stream) : (int)cudaErrorMemoryAllocation;
    if (rc != 0) {
        for (int i = 0; i < GRAPH_SLOTS; i++)
            fitm_cuda_tape_destroy(c->slots[i].tape);
        fitm_cuda_tape_destroy(c->rec);
        free(c);
        return fitm_cuda_status(rc, err, "CUDA backend: creating a stream");
    }
    cublasStatus_t st = cublasCreate(&c->blas);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasSetStream(c->blas, c->stream);
    if (st != CUBLAS_STATUS_SUCCESS) {
        fitm_backend_destroy(&c->base);
        return fitm_err_set(err, FITM_ERR_BACKEND, "CUDA backend: cuBLAS: %s",
                            cublasGetStatusName(st));
    }
    /* programmatic launches where the device runs them right (kernels/common.cuh) */
    const int probe = fitm_cuda_pdl_probe();
    if (probe < 0) /* a lost device: the first pass reports it */
        ok(c, -probe, "the programmatic launch probe");
    c->pdl_ok = probe == 1 && fitm_cuda_set_pdl(c->stream, true);
    size_t mem_free = 0, mem_total = 0;
    if (cudaMemGetInfo(&mem_free, &mem_total) == cudaSuccess)
        c->pool_cap = mem_total / 4;
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) == cudaSuccess)
        snprintf(c->device, sizeof c->device, "%.256s (sm_%d%d, %zu MiB)", p.name, p.major, p.minor,
                 p.totalGlobalMem >> 20);
    else
        snprintf(c->device, sizeof c->device, "CUDA device %d", device);
    *out = &c->base;
    return FITM_OK;
}

int fitm_backend_cuda_device_count(void)
{
    return fitm_cuda_device_count();
}

const char *fitm_backend_cuda_device(const fitm_backend *b)
{
    return ((const cuda_backend *)b)->device;
}

void fitm_backend_cuda_set_weights(fitm_backend *b, fitm_cuda_weights w)
{
    cu(b)->weights = w;
}

size_t fitm_backend_cuda_bf16_bytes(const fitm_backend *b)
{
    return ((const cuda_backend *)b)->bf16_bytes;
}
