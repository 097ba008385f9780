/*
 * Scaled fp8 matmuls from C (torch._scaled_mm semantics), on every rank of a
 * group: symm_fused_ag_mm and symm_mm_rs with e4m3/e5m2 operands,
 * tensor-wise and row-wise scales, biases and bf16/f16/f32 outputs, against
 * a float64 reference built from fp8 values this file decodes itself;
 * outputs poisoned, elements outside them left alone. fp8 outputs with
 * result scales against that reference rounded to the nearest fp8 code by
 * a search of this file's decoding (ties to even, saturating, NaN kept).
 * Then every fp8 argument check: the call fails on every rank and writes
 * nothing.
 */
#include "harness.h"
#include "tensors.h"

enum { TAG_A = 1, TAG_B = 10, TAG_SA = 20, TAG_SB = 30, TAG_BIAS = 40, TAG_RS = 50 };

/* Number of valid layouts of B in these tests: fp8 B is K-major. */
#define K 32

static void require(int ok, const char *what, int rank) {
    if (!ok) {
        fprintf(stderr, "rank %d: %s\n", rank, what);
        exit(1);
    }
}

/* A positive f32 scale in [1/4, 2), exact in f32. */
static float scale_value(uint64_t tag, int rank, int64_t i) {
    return (float)(0.25 + (double)(mix64(mix64(tag * 7919u + (uint64_t)rank) ^ (uint64_t)i) % 1792) / 1024.0);
}

static tbuf_t scales_make(int ndim, const int64_t *shape, uint64_t tag, int rank) {
    tbuf_t s = tb_make(SYMM_DTYPE_F32, ndim, shape, CONTIGUOUS);
    for (int64_t i = 0; i < numel(&s.t); i++) {
        float v = scale_value(tag, rank, i);
        memcpy(elem_ptr(&s.t, i), &v, 4);
    }
    return s;
}

static double scale_at(const tbuf_t *s, int64_t i) { return numel(&s->t) == 1 ? tb_get(s, 0) : tb_get(s, i); }

static void check_error(err_acc_t *e, int out_dtype, const char *what, int rank) {
    if (!(err_rel(e) <= tolerance(out_dtype))) {
        fprintf(stderr, "rank %d: %s: relative error %g\n", rank, what, err_rel(e));
        exit(1);
    }
}

/* ---- fused all-gather + scaled matmul ------------------------------------- */
typedef struct {
    int a_dtype, b_dtype, out_dtype, row_wise, ndim, gather_dim, with_bias, a_layout, out_layout;
} ag_case_t;

static void run_ag_mm(symm_group_t g, int rank, int world, const ag_case_t *c) {
    int64_t shard[3] = {4, K, 0}, gathered[3], out_shape[3], scale_shape[3];
    if (c->ndim == 3) { shard[0] = 2; shard[1] = 3; shard[2] = K; }
    int last = c->ndim - 1, num_b = 2;
    int64_t n[2] = {16, 32};
    memcpy(gathered, shard, sizeof gathered);
    gathered[c->gather_dim] *= world;
    int64_t k_total = gathered[last];
    memcpy(scale_shape, shard, sizeof scale_shape);
    scale_shape[last] = 1;

    tbuf_t a = tb_make(c->a_dtype, c->ndim, shard, c->a_layout), b[2], out[2], sb[2], bias[2];
    tb_fill(&a, TAG_A, rank);
    /* Tensor-wise a_scale: one value on every rank (it scales the whole gathered A). */
    int64_t one = 1;
    tbuf_t sa = c->row_wise ? scales_make(c->ndim, scale_shape, TAG_SA, rank) : scales_make(1, &one, TAG_SA, 0);
    symm_tensor_t bt[2], ot[2], sbt[2], biast[2];
    for (int i = 0; i < num_b; i++) {
        int64_t bshape[2] = {k_total, n[i]}, sbshape[2] = {1, n[i]};
        b[i] = tb_make(c->b_dtype, 2, bshape, COLUMN_MAJOR);
        tb_fill(&b[i], TAG_B + (uint64_t)i, rank);
        sb[i] = c->row_wise ? scales_make(2, sbshape, TAG_SB + (uint64_t)i, rank) : scales_make(1, &one, TAG_SB + (uint64_t)i, rank);
        bias[i] = tb_make(c->out_dtype, 1, &n[i], CONTIGUOUS);
        tb_fill(&bias[i], TAG_BIAS + (uint64_t)i, rank);
        memcpy(out_shape, gathered, sizeof out_shape);
        out_shape[last] = n[i];
        out[i] = tb_make(c->out_dtype, c->ndim, out_shape, c->out_layout);
        bt[i] = b[i].t;
        ot[i] = out[i].t;
        sbt[i] = sb[i].t;
        biast[i] = bias[i].t;
    }
    if (c->with_bias) biast[0].data = NULL; /* only outs[1] gets a bias */
    tbuf_t ag = tb_make(c->a_dtype, c->ndim, gathered, CONTIGUOUS);
    symm_ag_mm_options_t opts = SYMM_AG_MM_OPTIONS_INIT;
    opts.a_scale = &sa.t;
    opts.b_scales = sbt;
    opts.biases = c->with_bias ? biast : NULL;
    CHECK(symm_fused_ag_mm(g, &a.t, bt, num_b, c->gather_dim, &ag.t, ot, &opts, NULL));

    char what[200];
    snprintf(what, sizeof what, "ag_mm %s x %s -> %s %s ndim %d gather_dim %d bias %d layouts %d/%d",
             dtype_name(c->a_dtype), dtype_name(c->b_dtype), dtype_name(c->out_dtype),
             c->row_wise ? "row-wise" : "tensor-wise", c->ndim, c->gather_dim, c->with_bias, c->a_layout,
             c->out_layout);
    int64_t idx[3], local[3];
    /* The gathered A, exactly. */
    for (int64_t i = 0; i < numel(&ag.t); i++) {
        unravel(c->ndim, gathered, i, idx);
        memcpy(local, idx, sizeof local);
        int q = (int)(idx[c->gather_dim] / shard[c->gather_dim]);
        local[c->gather_dim] %= shard[c->gather_dim];
        require(tb_get(&ag, i) == value(c->a_dtype, TAG_A, q, ravel(c->ndim, shard, local)), what, rank);
    }
    for (int i = 0; i < num_b; i++) {
        err_acc_t e = {0, 0};
        for (int64_t j = 0; j < numel(&out[i].t); j++) {
            unravel(c->ndim, out[i].t.shape, j, idx);
            int64_t col = idx[last];
            /* The owner of this row and its row index in the owner's shard. */
            memcpy(local, idx, sizeof local);
            int q = c->gather_dim == last ? rank : (int)(idx[c->gather_dim] / shard[c->gather_dim]);
            if (c->gather_dim != last) local[c->gather_dim] %= shard[c->gather_dim];
            local[last] = 0;
            double sa_row = c->row_wise ? scale_value(TAG_SA, q, ravel(c->ndim, scale_shape, local)) : tb_get(&sa, 0);
            double dot = 0;
            for (int64_t k = 0; k < k_total; k++) {
                idx[last] = k;
                memcpy(local, idx, sizeof local);
                int owner = (int)(idx[c->gather_dim] / shard[c->gather_dim]);
                local[c->gather_dim] %= shard[c->gather_dim];
                dot += value(c->a_dtype, TAG_A, owner, ravel(c->ndim, shard, local)) * tb_get(&b[i], k * n[i] + col);
            }
            double ref = dot * sa_row * scale_at(&sb[i], col);
            if (c->with_bias && i == 1) ref += tb_get(&bias[i], col);
            err_add(&e, tb_get(&out[i], j), ref);
        }
        check_error(&e, c->out_dtype, what, rank);
        require(tb_outside_untouched(&out[i]), what, rank);
        tb_free(&b[i]);
        tb_free(&out[i]);
        tb_free(&sb[i]);
        tb_free(&bias[i]);
    }
    tb_free(&a);
    tb_free(&ag);
    tb_free(&sa);
}

static void ag_mm_results(symm_group_t g, int rank, int world) {
    const int outs[3] = {SYMM_DTYPE_BF16, SYMM_DTYPE_F16, SYMM_DTYPE_F32};
    const int types[3][2] = {{SYMM_DTYPE_FP8_E4M3, SYMM_DTYPE_FP8_E4M3},
                             {SYMM_DTYPE_FP8_E5M2, SYMM_DTYPE_FP8_E4M3},
                             {SYMM_DTYPE_FP8_E4M3, SYMM_DTYPE_FP8_E5M2}};
    int n = 0;
    for (int ti = 0; ti < 3; ti++)
        for (int oi = 0; oi < 3; oi++)
            for (int row_wise = 0; row_wise < 2; row_wise++)
                for (int ndim = 2; ndim <= 3; ndim++)
                    for (int gd = 0; gd < ndim; gd++, n++) {
                        if (row_wise && gd == ndim - 1) continue; /* unsupported; checked below */
                        ag_case_t c = {types[ti][0], types[ti][1], outs[oi], row_wise, ndim, gd,
                                       outs[oi] != SYMM_DTYPE_F32 && n % 2 == 0, n % 3 == 0 ? TRANSPOSED : CONTIGUOUS,
                                       n % 4 == 1 ? PADDED : CONTIGUOUS};
                        run_ag_mm(g, rank, world, &c);
                    }
}

/* ---- scaled matmul + reduce-scatter ----------------------------------------- */
typedef struct {
    int a_dtype, b_dtype, out_dtype, row_wise, ndim, scatter_dim, op, with_bias, a_layout, out_layout;
} rs_case_t;

static void run_mm_rs(symm_group_t g, int rank, int world, const rs_case_t *c) {
    int64_t w = world, shape[3] = {4 * w, K, 0}, full[3], chunk[3], scale_shape[3];
    if (c->ndim == 3) { shape[0] = 2 * w; shape[1] = w; shape[2] = K; } /* every dim divides by world */
    int last = c->ndim - 1;
    int64_t n = c->scatter_dim == last ? 16 * w : 32, one = 1;
    memcpy(full, shape, sizeof full);
    full[last] = n;
    memcpy(chunk, full, sizeof chunk);
    chunk[c->scatter_dim] /= world;
    memcpy(scale_shape, shape, sizeof scale_shape);
    scale_shape[last] = 1;
    int64_t bshape[2] = {K, n}, sbshape[2] = {1, n};
    tbuf_t a = tb_make(c->a_dtype, c->ndim, shape, c->a_layout), b = tb_make(c->b_dtype, 2, bshape, COLUMN_MAJOR);
    tbuf_t out = tb_make(c->out_dtype, c->ndim, chunk, c->out_layout), bias = tb_make(c->out_dtype, 1, &n, CONTIGUOUS);
    tbuf_t sa = c->row_wise ? scales_make(c->ndim, scale_shape, TAG_SA, rank) : scales_make(1, &one, TAG_SA, rank);
    tbuf_t sb = c->row_wise ? scales_make(2, sbshape, TAG_SB, rank) : scales_make(1, &one, TAG_SB, rank);
    tb_fill(&a, TAG_A, rank);
    tb_fill(&b, TAG_B, rank);
    tb_fill(&bias, TAG_BIAS, rank);
    symm_mm_rs_options_t opts = SYMM_MM_RS_OPTIONS_INIT;
    opts.a_scale = &sa.t;
    opts.b_scale = &sb.t;
    opts.bias = c->with_bias ? &bias.t : NULL;
    CHECK(symm_mm_rs(g, &a.t, &b.t, c->scatter_dim, c->op, &out.t, &opts, NULL));

    err_acc_t e = {0, 0};
    int64_t idx[3], sidx[3];
    for (int64_t j = 0; j < numel(&out.t); j++) {
        unravel(c->ndim, chunk, j, idx);
        idx[c->scatter_dim] += rank * chunk[c->scatter_dim];
        int64_t col = idx[last];
        memcpy(sidx, idx, sizeof sidx);
        sidx[last] = 0;
        double ref = 0;
        for (int q = 0; q < world; q++) {
            double dot = 0;
            for (int64_t k = 0; k < K; k++) {
                idx[last] = k;
                dot += value(c->a_dtype, TAG_A, q, ravel(c->ndim, shape, idx)) * value(c->b_dtype, TAG_B, q, k * n + col);
            }
            double sa_q = c->row_wise ? scale_value(TAG_SA, q, ravel(c->ndim, scale_shape, sidx)) : scale_value(TAG_SA, q, 0);
            double sb_q = scale_value(TAG_SB, q, c->row_wise ? col : 0);
            ref += dot * sa_q * sb_q + (c->with_bias ? value(c->out_dtype, TAG_BIAS, q, col) : 0.0);
        }
        if (c->op == SYMM_REDUCE_AVG) ref /= world;
        err_add(&e, tb_get(&out, j), ref);
    }
    char what[200];
    snprintf(what, sizeof what, "mm_rs %s x %s -> %s %s ndim %d scatter_dim %d op %d bias %d layouts %d/%d",
             dtype_name(c->a_dtype), dtype_name(c->b_dtype), dtype_name(c->out_dtype),
             c->row_wise ? "row-wise" : "tensor-wise", c->ndim, c->scatter_dim, c->op, c->with_bias, c->a_layout,
             c->out_layout);
    check_error(&e, c->out_dtype, what, rank);
    require(tb_outside_untouched(&out), what, rank);
    tb_free(&a);
    tb_free(&b);
    tb_free(&out);
    tb_free(&bias);
    tb_free(&sa);
    tb_free(&sb);
}

static void mm_rs_results(symm_group_t g, int rank, int world) {
    const int outs[3] = {SYMM_DTYPE_BF16, SYMM_DTYPE_F32, SYMM_DTYPE_F16};
    int n = 0;
    for (int oi = 0; oi < 3; oi++)
        for (int row_wise = 0; row_wise < 2; row_wise++)
            for (int ndim = 2; ndim <= 3; ndim++)
                for (int sd = 0; sd < ndim; sd++, n++) {
                    rs_case_t c = {n % 3 == 2 ? SYMM_DTYPE_FP8_E5M2 : SYMM_DTYPE_FP8_E4M3,
                                   n % 3 == 1 ? SYMM_DTYPE_FP8_E5M2 : SYMM_DTYPE_FP8_E4M3,
                                   outs[oi], row_wise, ndim, sd, n % 2 ? SYMM_REDUCE_AVG : SYMM_REDUCE_SUM,
                                   outs[oi] != SYMM_DTYPE_F32 && n % 4 < 2, n % 3 == 0 ? PADDED : CONTIGUOUS,
                                   n % 5 == 0 ? PADDED : CONTIGUOUS};
                    run_mm_rs(g, rank, world, &c);
                }
}

/* ---- fp8 outputs -------------------------------------------------------------- */
/* The code nearest to `v` (magnitudes past the largest finite value clamp to
 * it; ties to the even code; NaN to 0x7f), by searching the decoded codes. */
static uint8_t fp8_nearest(int dt, double v) {
    if (isnan(v)) return 0x7f;
    double a = fabs(v), max = 0;
    for (int b = 0; b < 0x80; b++)
        if (isfinite(fp8_to_f64(dt, (uint8_t)b)) && fp8_to_f64(dt, (uint8_t)b) > max) max = fp8_to_f64(dt, (uint8_t)b);
    if (a > max) a = max;
    int best = 0;
    for (int b = 0; b < 0x80; b++) {
        double x = fp8_to_f64(dt, (uint8_t)b);
        if (!isfinite(x)) continue;
        double d = fabs(x - a), db = fabs(fp8_to_f64(dt, (uint8_t)best) - a);
        if (d < db || (d == db && b % 2 == 0)) best = b;
    }
    return (uint8_t)(best | (v < 0 ? 0x80 : 0));
}

typedef struct { int64_t checked, saturated, nan, near_tie; } fp8_seen_t;

/* `got` is `ref` rounded: its nearest code, or, where f32 arithmetic may
 * fall on the other side of a midpoint (within 2^-14 of it, relatively),
 * the code on that side. */
static void check_fp8(fp8_seen_t *s, int dt, uint8_t got, double ref, const char *what, int rank) {
    uint8_t want = fp8_nearest(dt, ref);
    s->checked++;
    if (isnan(ref)) s->nan++;
    else if (fabs(ref) > fp8_to_f64(dt, dt == SYMM_DTYPE_FP8_E4M3 ? 0x7e : 0x7b)) s->saturated++;
    if (got == want) return;
    double g = fp8_to_f64(dt, got), w = fp8_to_f64(dt, want), mid = (g + w) / 2;
    int neighbours = (got & 0x80) == (want & 0x80) && abs((got & 0x7f) - (want & 0x7f)) == 1;
    if (neighbours && fabs(ref - mid) <= ldexp(fabs(ref), -14)) {
        s->near_tie++;
        return;
    }
    fprintf(stderr, "rank %d: %s: got %#04x (%g), want %#04x (%g) for %.9g\n", rank, what, got, g, want, w, ref);
    exit(1);
}

static tbuf_t result_scale_make(float v) {
    int64_t one = 1;
    tbuf_t s = tb_make(SYMM_DTYPE_F32, 1, &one, CONTIGUOUS);
    memcpy(s.t.data, &v, 4);
    return s;
}

/* ag_mm into two fp8 outputs: outs[0] with a bf16 bias and a result scale,
 * padded; outs[1] of the other format, neither. Rank 0's first A element is
 * NaN. */
static void run_ag_mm_fp8_out(symm_group_t g, int rank, int world, int row_wise, int out0) {
    int64_t shard[2] = {4, K}, n[2] = {16, 32}, one = 1, sshape[2] = {4, 1};
    int out1 = out0 == SYMM_DTYPE_FP8_E4M3 ? SYMM_DTYPE_FP8_E5M2 : SYMM_DTYPE_FP8_E4M3;
    float rs = out0 == SYMM_DTYPE_FP8_E4M3 ? 4.0f : 512.0f;
    tbuf_t a = tb_make(SYMM_DTYPE_FP8_E4M3, 2, shard, CONTIGUOUS), b[2], out[2], sb[2];
    tb_fill(&a, TAG_A, rank);
    if (rank == 0) *(uint8_t *)a.t.data = 0x7f;
    tbuf_t sa = row_wise ? scales_make(2, sshape, TAG_SA, rank) : scales_make(1, &one, TAG_SA, 0);
    tbuf_t bias = tb_make(SYMM_DTYPE_BF16, 1, &n[0], CONTIGUOUS), rsb = result_scale_make(rs);
    tb_fill(&bias, TAG_BIAS, rank);
    symm_tensor_t bt[2], ot[2], sbt[2], biast[2] = {bias.t, bias.t}, rst[2] = {rsb.t, rsb.t};
    biast[1].data = NULL;
    rst[1].data = NULL;
    for (int i = 0; i < 2; i++) {
        int64_t bshape[2] = {K, n[i]}, sbshape[2] = {1, n[i]}, oshape[2] = {4 * (int64_t)world, n[i]};
        b[i] = tb_make(SYMM_DTYPE_FP8_E5M2, 2, bshape, COLUMN_MAJOR);
        tb_fill(&b[i], TAG_B + (uint64_t)i, rank);
        sb[i] = row_wise ? scales_make(2, sbshape, TAG_SB + (uint64_t)i, rank) : scales_make(1, &one, TAG_SB + (uint64_t)i, rank);
        out[i] = tb_make(i == 0 ? out0 : out1, 2, oshape, i == 0 ? PADDED : CONTIGUOUS);
        bt[i] = b[i].t;
        ot[i] = out[i].t;
        sbt[i] = sb[i].t;
    }
    symm_ag_mm_options_t opts = SYMM_AG_MM_OPTIONS_INIT;
    opts.a_scale = &sa.t;
    opts.b_scales = sbt;
    opts.biases = biast;
    opts.result_scales = rst;
    CHECK(symm_fused_ag_mm(g, &a.t, bt, 2, 0, NULL, ot, &opts, NULL));
    char what[160];
    snprintf(what, sizeof what, "ag_mm fp8 outputs %s/%s %s", dtype_name(out0), dtype_name(out1),
             row_wise ? "row-wise" : "tensor-wise");
    fp8_seen_t seen = {0, 0, 0, 0};
    for (int i = 0; i < 2; i++) {
        for (int64_t j = 0; j < numel(&out[i].t); j++) {
            int64_t row = j / n[i], col = j % n[i], q = row / 4, r = row % 4;
            double dot = 0;
            for (int64_t k = 0; k < K; k++) {
                double av = q == 0 && r == 0 && k == 0 ? NAN : value(SYMM_DTYPE_FP8_E4M3, TAG_A, (int)q, r * K + k);
                dot += av * tb_get(&b[i], k * n[i] + col);
            }
            double sa_r = row_wise ? scale_value(TAG_SA, (int)q, r) : tb_get(&sa, 0);
            double ref = dot * sa_r * scale_at(&sb[i], col);
            if (i == 0) ref = (ref + tb_get(&bias, col)) * rs;
            check_fp8(&seen, i == 0 ? out0 : out1, *(uint8_t *)elem_ptr(&out[i].t, j), ref, what, rank);
        }
        require(tb_outside_untouched(&out[i]), what, rank);
    }
    require(seen.saturated > 0 && seen.nan > 0, "ag_mm fp8 outputs met saturation and NaN", rank);
    for (int i = 0; i < 2; i++) { tb_free(&b[i]); tb_free(&out[i]); tb_free(&sb[i]); }
    tb_free(&a); tb_free(&sa); tb_free(&bias); tb_free(&rsb);
}

/* mm_rs into a transposed fp8 out with a bf16 bias and a result scale:
 * the sum of the ranks' products (each with the bias, as torch), rounded
 * once. The last rank's first A element is NaN. */
static void run_mm_rs_fp8_out(symm_group_t g, int rank, int world, int out_dtype, int scatter_dim, int op, int row_wise) {
    int64_t w = world, shape[2] = {4 * w, K}, n = scatter_dim == 1 ? 16 * w : 32, one = 1;
    int64_t chunk[2] = {scatter_dim == 0 ? 4 : 4 * w, scatter_dim == 1 ? 16 : n}, bshape[2] = {K, n};
    int64_t sshape[2] = {4 * w, 1}, sbshape[2] = {1, n};
    float rs = out_dtype == SYMM_DTYPE_FP8_E4M3 ? 2.0f : 256.0f;
    tbuf_t a = tb_make(SYMM_DTYPE_FP8_E4M3, 2, shape, CONTIGUOUS), b = tb_make(SYMM_DTYPE_FP8_E5M2, 2, bshape, COLUMN_MAJOR);
    tbuf_t out = tb_make(out_dtype, 2, chunk, TRANSPOSED), bias = tb_make(SYMM_DTYPE_BF16, 1, &n, CONTIGUOUS);
    tbuf_t sa = row_wise ? scales_make(2, sshape, TAG_SA, rank) : scales_make(1, &one, TAG_SA, rank);
    tbuf_t sb = row_wise ? scales_make(2, sbshape, TAG_SB, rank) : scales_make(1, &one, TAG_SB, rank);
    tbuf_t rsb = result_scale_make(rs);
    tb_fill(&a, TAG_A, rank);
    if (rank == world - 1) *(uint8_t *)a.t.data = 0x7f;
    tb_fill(&b, TAG_B, rank);
    tb_fill(&bias, TAG_BIAS, 0); /* one bias on every rank */
    symm_mm_rs_options_t opts = SYMM_MM_RS_OPTIONS_INIT;
    opts.a_scale = &sa.t;
    opts.b_scale = &sb.t;
    opts.bias = &bias.t;
    opts.result_scale = &rsb.t;
    CHECK(symm_mm_rs(g, &a.t, &b.t, scatter_dim, op, &out.t, &opts, NULL));
    char what[160];
    snprintf(what, sizeof what, "mm_rs fp8 out %s scatter_dim %d op %d %s", dtype_name(out_dtype), scatter_dim, op,
             row_wise ? "row-wise" : "tensor-wise");
    fp8_seen_t seen = {0, 0, 0, 0};
    for (int64_t j = 0; j < numel(&out.t); j++) {
        int64_t row = j / chunk[1], col = j % chunk[1];
        if (scatter_dim == 0) row += rank * chunk[0];
        else col += rank * chunk[1];
        double ref = 0;
        for (int q = 0; q < world; q++) {
            double dot = 0;
            for (int64_t k = 0; k < K; k++) {
                double av = q == world - 1 && row == 0 && k == 0 ? NAN : value(SYMM_DTYPE_FP8_E4M3, TAG_A, q, row * K + k);
                dot += av * value(SYMM_DTYPE_FP8_E5M2, TAG_B, q, k * n + col);
            }
            double sa_q = row_wise ? scale_value(TAG_SA, q, row) : scale_value(TAG_SA, q, 0);
            ref += dot * sa_q * scale_value(TAG_SB, q, row_wise ? col : 0) + tb_get(&bias, col);
        }
        if (op == SYMM_REDUCE_AVG) ref /= world;
        check_fp8(&seen, out_dtype, *(uint8_t *)elem_ptr(&out.t, j), ref * rs, what, rank);
    }
    require(tb_outside_untouched(&out), what, rank);
    require(seen.saturated > 0, "mm_rs fp8 outputs met saturation", rank);
    tb_free(&a); tb_free(&b); tb_free(&out); tb_free(&bias); tb_free(&sa); tb_free(&sb); tb_free(&rsb);
}

static void fp8_out_results(symm_group_t g, int rank, int world) {
    for (int row_wise = 0; row_wise < 2; row_wise++) {
        run_ag_mm_fp8_out(g, rank, world, row_wise, row_wise ? SYMM_DTYPE_FP8_E5M2 : SYMM_DTYPE_FP8_E4M3);
        for (int sd = 0; sd < 2; sd++)
            for (int op = 0; op < 2; op++)
                run_mm_rs_fp8_out(g, rank, world, (sd + op) % 2 ? SYMM_DTYPE_FP8_E5M2 : SYMM_DTYPE_FP8_E4M3, sd,
                                  op ? SYMM_REDUCE_AVG : SYMM_REDUCE_SUM, row_wise);
    }
}

/* ---- argument checks ------------------------------------------------------------ */
/* A valid fp8 ag_mm call (row-wise, bias on outs[1]); each check breaks one thing. */
typedef struct {
    tbuf_t a, b[2], out[2], sa, sb[2], bias[2];
    symm_tensor_t at, bt[2], ot[2], sbt[2], biast[2];
    symm_ag_mm_options_t opts;
} ag_args_t;

static void ag_args(ag_args_t *x, int world) {
    int64_t a[2] = {4, K}, sa[2] = {4, 1}, n[2] = {16, 32};
    x->a = tb_make(SYMM_DTYPE_FP8_E4M3, 2, a, CONTIGUOUS);
    x->sa = tb_make(SYMM_DTYPE_F32, 2, sa, CONTIGUOUS);
    for (int i = 0; i < 2; i++) {
        int64_t b[2] = {K, n[i]}, sb[2] = {1, n[i]}, o[2] = {4 * (int64_t)world, n[i]};
        x->b[i] = tb_make(SYMM_DTYPE_FP8_E4M3, 2, b, COLUMN_MAJOR);
        x->out[i] = tb_make(SYMM_DTYPE_BF16, 2, o, CONTIGUOUS);
        x->sb[i] = tb_make(SYMM_DTYPE_F32, 2, sb, CONTIGUOUS);
        x->bias[i] = tb_make(SYMM_DTYPE_BF16, 1, &n[i], CONTIGUOUS);
        x->bt[i] = x->b[i].t;
        x->ot[i] = x->out[i].t;
        x->sbt[i] = x->sb[i].t;
        x->biast[i] = x->bias[i].t;
    }
    x->biast[0].data = NULL;
    x->at = x->a.t;
    x->opts = (symm_ag_mm_options_t)SYMM_AG_MM_OPTIONS_INIT;
    x->opts.a_scale = &x->sa.t;
    x->opts.b_scales = x->sbt;
    x->opts.biases = x->biast;
}

static void ag_args_free(ag_args_t *x) {
    EXPECT(tb_untouched(&x->out[0]) && tb_untouched(&x->out[1])); /* nothing written */
    tb_free(&x->a);
    tb_free(&x->sa);
    for (int i = 0; i < 2; i++) {
        tb_free(&x->b[i]);
        tb_free(&x->out[i]);
        tb_free(&x->sb[i]);
        tb_free(&x->bias[i]);
    }
}

#define EXPECT_FAIL(call, status, needle) \
    do {                                  \
        EXPECT_STATUS((call), (status));  \
        EXPECT_MESSAGE(needle);           \
    } while (0)

static void ag_mm_checks(symm_group_t g, int world) {
    ag_args_t x;
#define AG_MM(gd) symm_fused_ag_mm(g, &x.at, x.bt, 2, (gd), NULL, x.ot, &x.opts, NULL)
#define CASE(setup, gd, status, needle)          \
    do {                                         \
        ag_args(&x, world);                      \
        setup;                                   \
        EXPECT_FAIL(AG_MM(gd), status, needle);  \
        ag_args_free(&x);                        \
    } while (0)
    /* The valid call itself succeeds (and writes). */
    ag_args(&x, world);
    for (int i = 0; i < 2; i++) { tb_fill(&x.b[i], TAG_B, 0); tb_fill(&x.bias[i], TAG_BIAS, 0); }
    tb_fill(&x.a, TAG_A, 0);
    memset(x.sa.t.data, 0, 16); /* zero scales: finite results */
    memset(x.sb[0].t.data, 0, 64);
    memset(x.sb[1].t.data, 0, 128);
    CHECK(AG_MM(0));
    EXPECT(!tb_untouched(&x.out[0]) && tb_outside_untouched(&x.out[1]));
    tb_free(&x.a);
    tb_free(&x.sa);
    for (int i = 0; i < 2; i++) { tb_free(&x.b[i]); tb_free(&x.out[i]); tb_free(&x.sb[i]); tb_free(&x.bias[i]); }

    CASE(x.opts.a_scale = NULL, 0, SYMM_ERROR_INVALID_ARGUMENT,
         "a_shard is fp8_e4m3, and fp8 matmuls need scales: set opts->a_scale");
    CASE(x.opts.b_scales = NULL, 0, SYMM_ERROR_INVALID_ARGUMENT, "set opts->b_scales");
    CASE(x.bt[1] = x.b[0].t; x.bt[1].dtype = SYMM_DTYPE_BF16, 0, SYMM_ERROR_INVALID_ARGUMENT,
         "bs[1].dtype is bf16; expected an fp8 type, as a_shard is fp8_e4m3");
    CASE(x.at.dtype = SYMM_DTYPE_FP8_E5M2; x.bt[0].dtype = SYMM_DTYPE_FP8_E5M2, 0, SYMM_ERROR_UNSUPPORTED,
         "a_shard and bs[0] are both fp8_e5m2");
    /* Row-major B: the message names the layout needed. */
    CASE(x.bt[0].strides[0] = 16; x.bt[0].strides[1] = 1, 0, SYMM_ERROR_UNSUPPORTED, "need B column-major");
    CASE(x.bt[1].data = (char *)x.bt[1].data + 1, 0, SYMM_ERROR_UNSUPPORTED, "16-byte aligned");
    /* Result scales belong to fp8 outputs; an fp8 output's bias is bf16 or f16. */
    {
        int64_t one = 1;
        tbuf_t rs = tb_make(SYMM_DTYPE_F32, 1, &one, CONTIGUOUS);
        symm_tensor_t rst[2] = {rs.t, rs.t};
        rst[1].data = NULL;
        CASE(x.opts.result_scales = rst, 0, SYMM_ERROR_INVALID_ARGUMENT,
             "opts->result_scales[0] is set but outs[0] is bf16: a result scale applies to fp8 outputs only");
        CASE(x.ot[0].dtype = SYMM_DTYPE_FP8_E4M3; x.opts.result_scales = rst; rst[0].shape[0] = 2;
             rst[0].data = x.sa.t.data, 0, SYMM_ERROR_INVALID_ARGUMENT,
             "opts->result_scales[0].shape is [2]; expected one element");
        rst[0] = rs.t;
        CASE(x.ot[1].dtype = SYMM_DTYPE_FP8_E5M2; x.biast[1].dtype = SYMM_DTYPE_F32; x.biast[1].data = x.sb[1].t.data,
             0, SYMM_ERROR_INVALID_ARGUMENT, "opts->biases[1].dtype is f32; the bias of an fp8 output is bf16 or f16");
        tb_free(&rs);
    }
    CASE(x.sa.t.dtype = SYMM_DTYPE_BF16, 0, SYMM_ERROR_INVALID_ARGUMENT, "opts->a_scale.dtype is bf16; scales are f32");
    CASE(x.sa.t.shape[1] = 2, 0, SYMM_ERROR_INVALID_ARGUMENT, "opts->a_scale.shape is [4, 2]; expected [4, 1]");
    CASE(x.sbt[1].shape[0] = 32; x.sbt[1].shape[1] = 1, 0, SYMM_ERROR_INVALID_ARGUMENT,
         "opts->b_scales[1].shape is [32, 1]; expected [1, 32]");
    CASE(x.ot[1].dtype = SYMM_DTYPE_F32, 0, SYMM_ERROR_UNSUPPORTED, "a bias needs a bf16, f16 or fp8 output");
    CASE(x.biast[1].dtype = SYMM_DTYPE_F16, 0, SYMM_ERROR_INVALID_ARGUMENT,
         "opts->biases[1].dtype is f16; expected bf16, the dtype of outs[1]");
    CASE(x.biast[1].shape[0] = 16, 0, SYMM_ERROR_INVALID_ARGUMENT, "opts->biases[1].shape is [16]; expected [32]");
    CASE(x.biast[1].data = x.ot[1].data, 0, SYMM_ERROR_INVALID_ARGUMENT, "outs[1] overlaps opts->biases[1]");
    /* K of 24: a [4, 24] shard against [24, N] Bs. */
    CASE(x.at.shape[1] = 24; x.bt[0].shape[0] = 24; x.bt[1].shape[0] = 24, 0, SYMM_ERROR_UNSUPPORTED,
         "bs[0] has K = 24 and N = 16; fp8 matmuls need both to be multiples of 16");
    /* Gathering K with row-wise scales. */
    CASE(x.at = x.a.t; x.bt[0].shape[0] = K * world; x.bt[1].shape[0] = K * world;
         x.bt[0].strides[1] = K * world; x.bt[1].strides[1] = K * world;
         x.ot[0].shape[0] = 4; x.ot[1].shape[0] = 4, 1, SYMM_ERROR_UNSUPPORTED,
         "row-wise scales with gather_dim 1, the last dimension, are not supported");
    /* Scales with a bf16 matmul. */
    CASE(x.at.dtype = SYMM_DTYPE_BF16; x.at.shape[1] = 16, 0, SYMM_ERROR_INVALID_ARGUMENT,
         "opts->a_scale is set but a_shard is bf16: scales apply to fp8 matmuls only");
#undef CASE
#undef AG_MM
}

static void mm_rs_checks(symm_group_t g, int world) {
    int64_t w = world, as[2] = {2 * w, K}, bs[2] = {K, 16 * w}, os[2] = {2, 16 * w}, ssa[2] = {2 * w, 1},
            ssb[2] = {1, 16 * w}, n = 16 * w, one = 1;
    tbuf_t a = tb_make(SYMM_DTYPE_FP8_E4M3, 2, as, CONTIGUOUS), b = tb_make(SYMM_DTYPE_FP8_E4M3, 2, bs, COLUMN_MAJOR);
    tbuf_t out = tb_make(SYMM_DTYPE_F16, 2, os, CONTIGUOUS), bias = tb_make(SYMM_DTYPE_F16, 1, &n, CONTIGUOUS);
    tbuf_t sa = tb_make(SYMM_DTYPE_F32, 2, ssa, CONTIGUOUS), sb = tb_make(SYMM_DTYPE_F32, 2, ssb, CONTIGUOUS);
    tbuf_t s1 = tb_make(SYMM_DTYPE_F32, 1, &one, CONTIGUOUS);
    symm_mm_rs_options_t opts = SYMM_MM_RS_OPTIONS_INIT, o;
    opts.a_scale = &sa.t;
    opts.b_scale = &sb.t;
    opts.bias = &bias.t;
    symm_tensor_t t;
    char want[160];
#define MM_RS(dim, out_t, opts_p) symm_mm_rs(g, &a.t, &b.t, (dim), SYMM_REDUCE_SUM, (out_t), (opts_p), NULL)
    EXPECT_FAIL(MM_RS(0, &out.t, NULL), SYMM_ERROR_INVALID_ARGUMENT, "set opts->a_scale and opts->b_scale");
    o = opts;
    o.b_scale = NULL;
    EXPECT_FAIL(MM_RS(0, &out.t, &o), SYMM_ERROR_INVALID_ARGUMENT, "set opts->b_scale");
    /* Row-wise A scale with a tensor-wise B scale: the B scale is then the one of the wrong shape. */
    o = opts;
    o.b_scale = &s1.t;
    snprintf(want, sizeof want, "opts->b_scale.shape is [1]; expected [1, %d]", 16 * world);
    EXPECT_FAIL(MM_RS(0, &out.t, &o), SYMM_ERROR_INVALID_ARGUMENT, want);
    t = bias.t;
    t.shape[0] = 16;
    o = opts;
    o.bias = &t;
    if (world > 1) {
        snprintf(want, sizeof want, "opts->bias.shape is [16]; expected [%d]", 16 * world);
        EXPECT_FAIL(MM_RS(0, &out.t, &o), SYMM_ERROR_INVALID_ARGUMENT, want);
    }
    /* Scattering N: each rank's share of the columns is one matmul's N, so
     * a product of 8 * world columns leaves 8, not a multiple of 16. */
    {
        symm_tensor_t b8 = b.t, sb8 = sb.t, o8 = out.t;
        b8.shape[1] = sb8.shape[1] = 8 * w;
        o8.shape[0] = 2 * w;
        o8.shape[1] = 8;
        o8.strides[0] = 8;
        o = opts;
        o.b_scale = &sb8;
        o.bias = NULL;
        snprintf(want, sizeof want, "b has K = %d and N = 8", K);
        EXPECT_FAIL(symm_mm_rs(g, &a.t, &b8, 1, SYMM_REDUCE_SUM, &o8, &o, NULL), SYMM_ERROR_UNSUPPORTED, want);
    }
    /* Scales with an f16 matmul. */
    t = a.t;
    t.dtype = SYMM_DTYPE_F16;
    {
        symm_tensor_t b16 = b.t;
        b16.dtype = SYMM_DTYPE_F16;
        b16.data = bias.t.data; /* any aligned memory: the call fails before reading */
        EXPECT_FAIL(symm_mm_rs(g, &t, &b16, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                    "opts->a_scale is set but a is f16");
    }
    EXPECT(tb_untouched(&out));
    /* And the valid call works. */
    tb_fill(&a, TAG_A, 0);
    tb_fill(&b, TAG_B, 0);
    tb_fill(&bias, TAG_BIAS, 0);
    memset(sa.t.data, 0, (size_t)(2 * w * 4));
    memset(sb.t.data, 0, (size_t)(16 * w * 4));
    CHECK(MM_RS(0, &out.t, &opts));
    EXPECT(!tb_untouched(&out) && tb_outside_untouched(&out));
#undef MM_RS
    tb_free(&a);
    tb_free(&b);
    tb_free(&out);
    tb_free(&bias);
    tb_free(&sa);
    tb_free(&sb);
    tb_free(&s1);
}

/* Ranks that pass different scale modes fail together, writing nothing. */
static void disagreement(symm_group_t g, int rank, int world) {
    if (world < 2) return;
    int64_t as[2] = {2 * (int64_t)world, K}, bs[2] = {K, 16}, os[2] = {2, 16}, ssa[2] = {2 * (int64_t)world, 1},
            ssb[2] = {1, 16}, one = 1;
    tbuf_t a = tb_make(SYMM_DTYPE_FP8_E4M3, 2, as, CONTIGUOUS), b = tb_make(SYMM_DTYPE_FP8_E4M3, 2, bs, COLUMN_MAJOR);
    tbuf_t out = tb_make(SYMM_DTYPE_BF16, 2, os, CONTIGUOUS);
    int odd = rank == world - 1;
    tbuf_t sa = odd ? tb_make(SYMM_DTYPE_F32, 2, ssa, CONTIGUOUS) : tb_make(SYMM_DTYPE_F32, 1, &one, CONTIGUOUS);
    tbuf_t sb = odd ? tb_make(SYMM_DTYPE_F32, 2, ssb, CONTIGUOUS) : tb_make(SYMM_DTYPE_F32, 1, &one, CONTIGUOUS);
    symm_mm_rs_options_t opts = SYMM_MM_RS_OPTIONS_INIT;
    opts.a_scale = &sa.t;
    opts.b_scale = &sb.t;
    char want[128];
    snprintf(want, sizeof want, "opts->a_scale.shape is [1] on rank 0 but [%d, 1] on rank %d", 2 * world, world - 1);
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL), SYMM_ERROR_MISMATCH, want);
    EXPECT(tb_untouched(&out));
    tb_free(&a);
    tb_free(&b);
    tb_free(&out);
    tb_free(&sa);
    tb_free(&sb);
}

static int rank_main(symm_group_t g, int rank, int world) {
    ag_mm_results(g, rank, world);
    mm_rs_results(g, rank, world);
    fp8_out_results(g, rank, world);
    ag_mm_checks(g, world);
    mm_rs_checks(g, world);
    disagreement(g, rank, world);
    return 0;
}

int main(int argc, char **argv) { return harness_main(argc, argv, rank_main); }
