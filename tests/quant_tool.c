/* quant_tool: command-line access to the quant module for the Python oracle tests.
 *
 *   quant_tool quant   TYPE in.f32 out.bin                 quantize (N from the file size)
 *   quant_tool dequant TYPE in.bin out.f32 N [scalar]      dequantize N values
 *   quant_tool matvec  TYPE w.bin x.f32 N K y.f32 xq.bin [scalar]
 *        y (N) = W (N, K) . x; writes the quantized activation x_q too
 *   quant_tool matmul  TYPE w.bin x.f32 N K M y.f32        Y (M, N) = X (M, K) . W^T
 *
 * TYPE is a name (Q4_K, F16, ...). Files are raw little-endian arrays. "scalar" selects the
 * portable path instead of the vectorised one. Exit status 0 on success, 2 on bad usage or
 * I/O errors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "compute/quant.h"
#include "compute/quant_internal.h"

static int die(const char *msg, const char *arg)
{
    fprintf(stderr, "quant_tool: %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    return 2;
}

static void *read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    void *buf = NULL;
    long len;
    if (fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
        buf = malloc((size_t)len + 1);
        if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
            free(buf);
            buf = NULL;
        }
        *size = (size_t)len;
    }
    fclose(f);
    return buf;
}

static int write_file(const char *path, const void *buf, size_t size)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t w = fwrite(buf, 1, size, f);
    return (fclose(f) == 0 && w == size) ? 0 : -1;
}

static int parse_type(const char *name, fitm_dtype *t)
{
    for (int id = 0; id < FITM_DTYPE_MAX; id++) {
        const fitm_dtype_info *info = fitm_dtype_info_of(id);
        if (info && strcasecmp(info->name, name) == 0) {
            *t = (fitm_dtype)id;
            return 0;
        }
    }
    return -1;
}

static int cmd_quant(fitm_dtype t, const char *in, const char *out)
{
    size_t size;
    float *x = read_file(in, &size);
    if (!x)
        return die("cannot read", in);
    int64_t n = (int64_t)(size / sizeof(float));
    size_t rb = fitm_dtype_row_bytes(t, n);
    if (rb == 0 && n != 0) {
        free(x);
        return die("element count is not a multiple of the block size", in);
    }
    void *q = malloc(rb + 1);
    fitm_quant_row(t, x, q, n);
    int rc = write_file(out, q, rb);
    free(x);
    free(q);
    return rc ? die("cannot write", out) : 0;
}

static int cmd_dequant(fitm_dtype t, const char *in, const char *out, int64_t n, int scalar)
{
    size_t size;
    void *q = read_file(in, &size);
    if (!q)
        return die("cannot read", in);
    size_t rb = fitm_dtype_row_bytes(t, n);
    if ((rb == 0 && n != 0) || size < rb) {
        free(q);
        return die("file too short or N not a multiple of the block size", in);
    }
    float *y = malloc((size_t)n * sizeof(float) + 1);
    if (scalar)
        fitm_quant_dequant_row_scalar(t, q, y, n);
    else
        fitm_dequant_row(t, q, y, n);
    int rc = write_file(out, y, (size_t)n * sizeof(float));
    free(q);
    free(y);
    return rc ? die("cannot write", out) : 0;
}

static int cmd_matvec(fitm_dtype t, char **a, int scalar)
{
    /* a: w.bin x.f32 N K y.f32 xq.bin */
    int64_t N = atoll(a[2]), K = atoll(a[3]);
    size_t wsize, xsize, rb = fitm_dtype_row_bytes(t, K);
    fitm_dtype vt = fitm_quant_vec_dtype(t);
    size_t xqb = fitm_dtype_row_bytes(vt, K);
    if (N <= 0 || K <= 0 || rb == 0 || xqb == 0)
        return die("bad N or K", a[3]);
    void *w = read_file(a[0], &wsize);
    float *x = read_file(a[1], &xsize);
    int rc = 0;
    if (!w || !x || wsize < rb * (size_t)N || xsize < (size_t)K * sizeof(float)) {
        rc = die("cannot read inputs or they are too short", a[0]);
        goto done;
    }
    void *xq = malloc(xqb);
    float *y = malloc((size_t)N * sizeof(float));
    fitm_quant_row(vt, x, xq, K);
    if (scalar) {
        for (int64_t n = 0; n < N; n++)
            y[n] = fitm_quant_dot_scalar(t, (const uint8_t *)w + (size_t)n * rb, xq, K);
    } else {
        fitm_matvec(t, w, K, xq, y, 0, N);
    }
    if (write_file(a[4], y, (size_t)N * sizeof(float)) || write_file(a[5], xq, xqb))
        rc = die("cannot write", a[4]);
    free(xq);
    free(y);
done:
    free(w);
    free(x);
    return rc;
}

static int cmd_matmul(fitm_dtype t, char **a)
{
    /* a: w.bin x.f32 N K M y.f32 */
    int64_t N = atoll(a[2]), K = atoll(a[3]), M = atoll(a[4]);
    size_t wsize, xsize, rb = fitm_dtype_row_bytes(t, K);
    if (N <= 0 || K <= 0 || M <= 0 || rb == 0)
        return die("bad N, K or M", a[3]);
    void *w = read_file(a[0], &wsize);
    float *x = read_file(a[1], &xsize);
    int rc = 0;
    if (!w || !x || wsize < rb * (size_t)N || xsize < (size_t)(M * K) * sizeof(float)) {
        rc = die("cannot read inputs or they are too short", a[0]);
        goto done;
    }
    fitm_quant_blas_single_thread();
    float *scratch = malloc(fitm_matmul_scratch_floats(K) * sizeof(float));
    float *y = malloc((size_t)(M * N) * sizeof(float));
    fitm_matmul(t, w, K, x, M, y, N, 0, N, scratch);
    if (write_file(a[5], y, (size_t)(M * N) * sizeof(float)))
        rc = die("cannot write", a[5]);
    free(scratch);
    free(y);
done:
    free(w);
    free(x);
    return rc;
}

int main(int argc, char **argv)
{
    fitm_dtype t;
    if (argc < 3 || parse_type(argv[2], &t) != 0)
        return die("usage: quant_tool quant|dequant|matvec|matmul TYPE ... (see source)", NULL);
    if (t != FITM_DTYPE_Q8_K && !fitm_quant_supported(t))
        return die("unsupported type", argv[2]);
    const char *cmd = argv[1];
    if (strcmp(cmd, "quant") == 0 && argc == 5)
        return cmd_quant(t, argv[3], argv[4]);
    if (strcmp(cmd, "dequant") == 0 && (argc == 6 || argc == 7))
        return cmd_dequant(t, argv[3], argv[4], atoll(argv[5]), argc == 7 && !strcmp(argv[6], "scalar"));
    if (strcmp(cmd, "matvec") == 0 && (argc == 9 || argc == 10) && t != FITM_DTYPE_Q8_K)
        return cmd_matvec(t, argv + 3, argc == 10 && !strcmp(argv[9], "scalar"));
    if (strcmp(cmd, "matmul") == 0 && argc == 9 && t != FITM_DTYPE_Q8_K)
        return cmd_matmul(t, argv + 3);
    return die("bad command or argument count", cmd);
}
