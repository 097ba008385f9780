/*
 * The operations from C, on every rank of a group: results against a
 * float64 reference (every gather/scatter dimension, several B, strided
 * inputs and outputs, each dtype), elements outside the outputs left alone,
 * in-place and copied all-gathers, every argument check (the call fails on
 * every rank and writes nothing), and ranks that disagree or fail alone.
 *
 * With env SYMM_CHECK_ARGS=always it also checks that a disagreement is
 * caught on a call whose arguments were agreed before.
 */
#include "harness.h"
#include "tensors.h"

/* Tags of the test tensors, so that each has its own values. */
enum { TAG_A = 1, TAG_B = 10, TAG_IN = 30 };

/* Fails the rank with `what` unless `ok`. */
static void require(int ok, const char *what, int rank) {
    if (!ok) {
        fprintf(stderr, "rank %d: %s\n", rank, what);
        exit(1);
    }
}

/* ---- fused all-gather + matmul -------------------------------------------- */
typedef struct {
    int dtype, ndim, gather_dim, num_b;
    int64_t shard[4];
    int64_t n[3];
    int a_layout, out_layout, want_ag;
} ag_case_t;

/* Rank q's element of the gathered A at multi-index gidx. */
static double gathered_value(const ag_case_t *c, const int64_t *gidx) {
    int64_t local[4];
    memcpy(local, gidx, sizeof local);
    int q = (int)(gidx[c->gather_dim] / c->shard[c->gather_dim]);
    local[c->gather_dim] %= c->shard[c->gather_dim];
    return value(c->dtype, TAG_A, q, ravel(c->ndim, c->shard, local));
}

static void run_ag_mm(symm_group_t g, int rank, int world, const ag_case_t *c) {
    int last = c->ndim - 1;
    int64_t gathered[4], out_shape[4], k_total;
    memcpy(gathered, c->shard, sizeof gathered);
    gathered[c->gather_dim] *= world;
    k_total = gathered[last];
    tbuf_t a = tb_make(c->dtype, c->ndim, c->shard, c->a_layout), b[3], out[3], ag;
    tb_fill(&a, TAG_A, rank);
    symm_tensor_t bt[3], ot[3];
    for (int i = 0; i < c->num_b; i++) {
        int64_t bshape[2] = {k_total, c->n[i]};
        b[i] = tb_make(c->dtype, 2, bshape, i == 1 ? TRANSPOSED : CONTIGUOUS);
        tb_fill(&b[i], TAG_B + (uint64_t)i, rank);
        memcpy(out_shape, gathered, sizeof out_shape);
        out_shape[last] = c->n[i];
        out[i] = tb_make(c->dtype, c->ndim, out_shape, c->out_layout);
        bt[i] = b[i].t;
        ot[i] = out[i].t;
    }
    ag = tb_make(c->dtype, c->ndim, gathered, c->out_layout);
    CHECK(symm_fused_ag_mm(g, &a.t, bt, c->num_b, c->gather_dim, c->want_ag ? &ag.t : NULL, ot, NULL, NULL));

    char what[160];
    snprintf(what, sizeof what, "ag_mm %s ndim %d gather_dim %d layouts %d/%d", dtype_name(c->dtype), c->ndim,
             c->gather_dim, c->a_layout, c->out_layout);
    int64_t idx[4];
    if (c->want_ag) {
        for (int64_t i = 0; i < numel(&ag.t); i++) {
            unravel(c->ndim, gathered, i, idx);
            require(tb_get(&ag, i) == gathered_value(c, idx), what, rank);
        }
        require(tb_outside_untouched(&ag), what, rank);
    } else {
        require(tb_untouched(&ag), what, rank);
    }
    for (int i = 0; i < c->num_b; i++) {
        err_acc_t e = {0, 0};
        for (int64_t j = 0; j < numel(&out[i].t); j++) {
            unravel(c->ndim, out[i].t.shape, j, idx);
            int64_t col = idx[last];
            double ref = 0;
            for (int64_t k = 0; k < k_total; k++) {
                idx[last] = k;
                ref += gathered_value(c, idx) * tb_get(&b[i], k * c->n[i] + col);
            }
            err_add(&e, tb_get(&out[i], j), ref);
        }
        if (!(err_rel(&e) <= tolerance(c->dtype))) {
            fprintf(stderr, "rank %d: %s: outs[%d] relative error %g\n", rank, what, i, err_rel(&e));
            exit(1);
        }
        require(tb_outside_untouched(&out[i]), what, rank);
        tb_free(&b[i]);
        tb_free(&out[i]);
    }
    tb_free(&a);
    tb_free(&ag);
}

static void ag_mm_results(symm_group_t g, int rank, int world) {
    const int dtypes[3] = {SYMM_DTYPE_F32, SYMM_DTYPE_BF16, SYMM_DTYPE_F16};
    int n = 0;
    for (int di = 0; di < 3; di++)
        for (int ndim = 2; ndim <= 3; ndim++)
            for (int gd = 0; gd < ndim; gd++)
                for (int a_layout = 0; a_layout < 2; a_layout++, n++) {
                    ag_case_t c = {dtypes[di], ndim, gd, 2 + (n % 4 == 0), {3, 8, 0, 0}, {5, 3, 4},
                                   a_layout ? TRANSPOSED : CONTIGUOUS, n % 3, n % 2};
                    if (ndim == 3) { c.shard[0] = 2; c.shard[1] = 3; c.shard[2] = 4; }
                    run_ag_mm(g, rank, world, &c);
                }
}

/* ---- fused matmul + reduce-scatter --------------------------------------- */
typedef struct {
    int dtype, ndim, scatter_dim, op;
    int64_t a[4];
    int64_t n;
    int a_layout, out_layout;
} rs_case_t;

static void run_mm_rs(symm_group_t g, int rank, int world, const rs_case_t *c) {
    int last = c->ndim - 1;
    int64_t k = c->a[last], full[4], chunk[4];
    memcpy(full, c->a, sizeof full);
    full[last] = c->n;
    memcpy(chunk, full, sizeof chunk);
    chunk[c->scatter_dim] /= world;
    int64_t bshape[2] = {k, c->n};
    tbuf_t a = tb_make(c->dtype, c->ndim, c->a, c->a_layout);
    tbuf_t b = tb_make(c->dtype, 2, bshape, CONTIGUOUS);
    tbuf_t out = tb_make(c->dtype, c->ndim, chunk, c->out_layout);
    tb_fill(&a, TAG_A, rank);
    tb_fill(&b, TAG_B, rank);
    CHECK(symm_mm_rs(g, &a.t, &b.t, c->scatter_dim, c->op, &out.t, NULL, NULL));

    err_acc_t e = {0, 0};
    int64_t idx[4];
    for (int64_t j = 0; j < numel(&out.t); j++) {
        unravel(c->ndim, chunk, j, idx);
        idx[c->scatter_dim] += rank * chunk[c->scatter_dim];
        int64_t col = idx[last];
        double ref = 0;
        for (int q = 0; q < world; q++)
            for (int64_t kk = 0; kk < k; kk++) {
                idx[last] = kk;
                ref += value(c->dtype, TAG_A, q, ravel(c->ndim, c->a, idx)) * value(c->dtype, TAG_B, q, kk * c->n + col);
            }
        if (c->op == SYMM_REDUCE_AVG) ref /= world;
        err_add(&e, tb_get(&out, j), ref);
    }
    if (!(err_rel(&e) <= tolerance(c->dtype))) {
        fprintf(stderr, "rank %d: mm_rs %s ndim %d scatter_dim %d op %d layouts %d/%d: relative error %g\n", rank,
                dtype_name(c->dtype), c->ndim, c->scatter_dim, c->op, c->a_layout, c->out_layout, err_rel(&e));
        exit(1);
    }
    EXPECT(tb_outside_untouched(&out));
    tb_free(&a);
    tb_free(&b);
    tb_free(&out);
}

static void mm_rs_results(symm_group_t g, int rank, int world) {
    const int dtypes[3] = {SYMM_DTYPE_F32, SYMM_DTYPE_BF16, SYMM_DTYPE_F16};
    int64_t w = world;
    int n = 0;
    for (int di = 0; di < 3; di++)
        for (int ndim = 2; ndim <= 3; ndim++)
            for (int sd = 0; sd < ndim; sd++)
                for (int op = 0; op < 2; op++, n++) {
                    /* Every dimension of the product divides by the world size. */
                    rs_case_t c = {dtypes[di], ndim, sd, op ? SYMM_REDUCE_AVG : SYMM_REDUCE_SUM,
                                   {2 * w, 6, 0, 0}, 2 * w, n % 2 ? PADDED : CONTIGUOUS, n % 3};
                    if (ndim == 3) { c.a[0] = 2 * w; c.a[1] = w; c.a[2] = 5; c.n = 3 * w; }
                    run_mm_rs(g, rank, world, &c);
                }
}

/* ---- low-contention all-gather --------------------------------------------- */
/* `in_symm`: the input lies in a rendezvoused buffer, read in place. */
static void run_lc(symm_group_t g, int rank, int world, int dtype, int in_layout, int out_layout, int in_symm) {
    int64_t in_shape[3] = {3, 2, 5}, out_shape[3] = {3 * (int64_t)world, 2, 5};
    size_t es = dtype_size(dtype);
    tbuf_t in = tb_make(dtype, 3, in_shape, in_layout);
    tbuf_t out = tb_make(dtype, 3, out_shape, out_layout);
    symm_buffer_t buf = NULL;
    symm_handle_t h = NULL;
    symm_tensor_t t = in.t;
    if (in_symm) {
        CHECK(symm_create(g, 4096, &buf));
        CHECK(symm_rendezvous(buf, &h));
        unsigned char *p;
        CHECK(symm_buffer_ptr(buf, (void **)&p));
        t = symm_tensor_contiguous(p + 64 * es, dtype, 3, in_shape);
    }
    for (int64_t i = 0; i < numel(&t); i++) value_bytes(dtype, TAG_IN, rank, i, elem_ptr(&t, i));
    CHECK(symm_lc_allgather(g, &t, &out.t, NULL));
    unsigned char want[4];
    int64_t idx[3];
    for (int64_t i = 0; i < numel(&out.t); i++) {
        unravel(3, out_shape, i, idx);
        int q = (int)(idx[0] / 3);
        idx[0] %= 3;
        value_bytes(dtype, TAG_IN, q, ravel(3, in_shape, idx), want);
        if (memcmp(elem_ptr(&out.t, i), want, es)) {
            fprintf(stderr, "rank %d: lc_allgather %s layouts %d/%d symm %d: element %ld differs\n", rank,
                    dtype_name(dtype), in_layout, out_layout, in_symm, (long)i);
            exit(1);
        }
    }
    EXPECT(tb_outside_untouched(&out));
    if (h) {
        CHECK(symm_handle_destroy(h));
        CHECK(symm_buffer_destroy(buf));
    }
    tb_free(&in);
    tb_free(&out);
}

static void lc_results(symm_group_t g, int rank, int world) {
    const int dtypes[5] = {SYMM_DTYPE_F32, SYMM_DTYPE_BF16, SYMM_DTYPE_F16, SYMM_DTYPE_FP8_E4M3, SYMM_DTYPE_FP8_E5M2};
    for (int di = 0; di < 5; di++) {
        run_lc(g, rank, world, dtypes[di], CONTIGUOUS, CONTIGUOUS, 0);
        run_lc(g, rank, world, dtypes[di], TRANSPOSED, PADDED, 0);
        run_lc(g, rank, world, dtypes[di], CONTIGUOUS, TRANSPOSED, 1);
    }
}

/* ---- argument checks -------------------------------------------------------- */
/* A valid call's tensors, poisoned; each check breaks one thing. */
typedef struct {
    tbuf_t a, b[2], out[2], ag;
    symm_tensor_t at, bt[2], ot[2], agt;
} ag_args_t;

static ag_args_t ag_args(int world) {
    ag_args_t x;
    int64_t a[2] = {4, 6}, b0[2] = {6, 5}, b1[2] = {6, 3}, o0[2] = {4 * (int64_t)world, 5},
            o1[2] = {4 * (int64_t)world, 3}, g[2] = {4 * (int64_t)world, 6};
    x.a = tb_make(SYMM_DTYPE_BF16, 2, a, CONTIGUOUS);
    x.b[0] = tb_make(SYMM_DTYPE_BF16, 2, b0, CONTIGUOUS);
    x.b[1] = tb_make(SYMM_DTYPE_BF16, 2, b1, CONTIGUOUS);
    x.out[0] = tb_make(SYMM_DTYPE_BF16, 2, o0, CONTIGUOUS);
    x.out[1] = tb_make(SYMM_DTYPE_BF16, 2, o1, CONTIGUOUS);
    x.ag = tb_make(SYMM_DTYPE_BF16, 2, g, CONTIGUOUS);
    x.at = x.a.t;
    x.agt = x.ag.t;
    for (int i = 0; i < 2; i++) { x.bt[i] = x.b[i].t; x.ot[i] = x.out[i].t; }
    return x;
}

static void ag_args_free(ag_args_t *x) {
    EXPECT(tb_untouched(&x->out[0]) && tb_untouched(&x->out[1]) && tb_untouched(&x->ag)); /* nothing written */
    tb_free(&x->a);
    tb_free(&x->ag);
    for (int i = 0; i < 2; i++) { tb_free(&x->b[i]); tb_free(&x->out[i]); }
}

#define AG_MM(x, opts) symm_fused_ag_mm(g, &(x).at, (x).bt, 2, 0, &(x).agt, (x).ot, (opts), NULL)

/* The call fails with `status` and a message containing `needle`, on every rank. */
#define EXPECT_FAIL(call, status, needle)                                                   \
    do {                                                                                    \
        EXPECT_STATUS((call), (status));                                                    \
        EXPECT_MESSAGE(needle);                                                             \
    } while (0)

static void ag_mm_checks(symm_group_t g, int world) {
    ag_args_t x;
    char want[96];
#define CASE(setup, status, needle)                 \
    do {                                            \
        x = ag_args(world);                         \
        setup;                                      \
        EXPECT_FAIL(AG_MM(x, NULL), status, needle); \
        ag_args_free(&x);                           \
    } while (0)
    CASE(x.at.ndim = 1, SYMM_ERROR_INVALID_ARGUMENT, "a_shard.ndim is 1; expected at least 2");
    CASE(x.at.ndim = 9, SYMM_ERROR_INVALID_ARGUMENT, "a_shard.ndim is 9; expected 1 to 8");
    CASE(x.at.dtype = 77, SYMM_ERROR_INVALID_ARGUMENT, "a_shard.dtype is 77");
    CASE(x.at.shape[0] = 0, SYMM_ERROR_INVALID_ARGUMENT, "a_shard.shape[0] is 0; expected at least 1");
    CASE(x.at.strides[1] = -1, SYMM_ERROR_INVALID_ARGUMENT, "a_shard.strides[1] is -1; expected at least 0");
    CASE(x.at.data = NULL, SYMM_ERROR_INVALID_ARGUMENT, "a_shard.data is NULL");
    CASE(x.at.data = (char *)x.at.data + 1, SYMM_ERROR_INVALID_ARGUMENT, "expected a multiple of the bf16 size (2)");
    CASE(x.at.shape[0] = INT64_MAX / 2, SYMM_ERROR_INVALID_ARGUMENT, "larger than the address space");
    /* An extent between 2^63 and 2^64 bytes fits a u64 but no object. */
    CASE(x.at.strides[0] = INT64_C(1) << 62, SYMM_ERROR_INVALID_ARGUMENT, "a_shard (shape [4, 6], strides");
    CASE(x.ot[1].strides[0] = INT64_C(1) << 62, SYMM_ERROR_INVALID_ARGUMENT, "larger than the address space");
    CASE(x.bt[1].dtype = SYMM_DTYPE_F16, SYMM_ERROR_INVALID_ARGUMENT, "bs[1].dtype is f16; expected bf16");
    CASE(x.bt[0].ndim = 3, SYMM_ERROR_INVALID_ARGUMENT, "bs[0].ndim is 3; expected 2");
    CASE(x.bt[1].shape[0] = 5, SYMM_ERROR_INVALID_ARGUMENT, "bs[1].shape[0] is 5; expected 6");
    snprintf(want, sizeof want, "outs[1].shape is [%d, 4]; expected [%d, 3]", 4 * world, 4 * world);
    CASE(x.ot[1].shape[1] = 4, SYMM_ERROR_INVALID_ARGUMENT, want);
    snprintf(want, sizeof want, "ag_out.shape is [4, 6]; expected [%d, 6]", 4 * world);
    if (world > 1) CASE(x.agt.shape[0] = 4, SYMM_ERROR_INVALID_ARGUMENT, want);
    CASE(x.agt.dtype = SYMM_DTYPE_F16, SYMM_ERROR_INVALID_ARGUMENT, "ag_out.dtype is f16; expected bf16");
    CASE(x.ot[0].strides[0] = 0, SYMM_ERROR_INVALID_ARGUMENT, "its elements overlap");
    CASE(x.ot[1].data = x.ot[0].data, SYMM_ERROR_INVALID_ARGUMENT, "outs[1] overlaps outs[0]");
    CASE(x.agt.data = x.at.data, SYMM_ERROR_INVALID_ARGUMENT, "ag_out overlaps a_shard");
    CASE(x.ot[0].data = x.bt[0].data, SYMM_ERROR_INVALID_ARGUMENT, "outs[0] overlaps");
    CASE(x.ot[0].dtype = SYMM_DTYPE_F32, SYMM_ERROR_UNSUPPORTED, "outs[0].dtype is f32 but the inputs are bf16");
    CASE(x.at.dtype = SYMM_DTYPE_FP8_E4M3, SYMM_ERROR_INVALID_ARGUMENT, "a_shard is fp8_e4m3, and fp8 matmuls need scales");
#undef CASE

    x = ag_args(world);
    EXPECT_FAIL(symm_fused_ag_mm(g, NULL, x.bt, 2, 0, NULL, x.ot, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "a_shard is NULL");
    EXPECT_FAIL(symm_fused_ag_mm(g, &x.at, x.bt, 0, 0, NULL, x.ot, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "num_b is 0; expected at least 1");
    EXPECT_FAIL(symm_fused_ag_mm(g, &x.at, x.bt, 2, 2, NULL, x.ot, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "gather_dim is 2; expected 0..1 (a_shard has 2 dimensions)");
    EXPECT_FAIL(symm_fused_ag_mm(g, &x.at, x.bt, 2, -1, NULL, x.ot, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "gather_dim is -1");
    EXPECT_FAIL(symm_fused_ag_mm(g, &x.at, x.bt, 2, 0, NULL, NULL, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "outs is NULL");
    EXPECT_FAIL(symm_fused_ag_mm(NULL, &x.at, x.bt, 2, 0, NULL, x.ot, NULL, NULL), SYMM_ERROR_INVALID_HANDLE,
                "NULL");

    symm_ag_mm_options_t opts = SYMM_AG_MM_OPTIONS_INIT;
    opts.a_scale = &x.at;
    EXPECT_FAIL(AG_MM(x, &opts), SYMM_ERROR_INVALID_ARGUMENT, "opts->a_scale is set but a_shard is bf16");
    opts = (symm_ag_mm_options_t)SYMM_AG_MM_OPTIONS_INIT;
    opts.biases = x.bt;
    EXPECT_FAIL(AG_MM(x, &opts), SYMM_ERROR_UNSUPPORTED, "opts->biases is set but a_shard is bf16");
    opts = (symm_ag_mm_options_t)SYMM_AG_MM_OPTIONS_INIT;
    opts.struct_size = sizeof(size_t);
    EXPECT_FAIL(AG_MM(x, &opts), SYMM_ERROR_INVALID_ARGUMENT, "SYMM_AG_MM_OPTIONS_INIT");
    /* A caller compiled against a newer, longer struct, using a field this version does not know. */
    struct { symm_ag_mm_options_t v1; int64_t newer; } longer = {SYMM_AG_MM_OPTIONS_INIT, 1};
    longer.v1.struct_size = sizeof longer;
    EXPECT_FAIL(AG_MM(x, &longer.v1), SYMM_ERROR_UNSUPPORTED, "does not know");
    ag_args_free(&x);

    /* The same struct with the new field left zero is fine, as are default options. */
    x = ag_args(world);
    longer.newer = 0;
    tb_fill(&x.a, TAG_A, 0);
    tb_fill(&x.b[0], TAG_B, 0);
    tb_fill(&x.b[1], TAG_B, 1);
    CHECK(AG_MM(x, &longer.v1));
    opts = (symm_ag_mm_options_t)SYMM_AG_MM_OPTIONS_INIT;
    CHECK(AG_MM(x, &opts));
    EXPECT(tb_outside_untouched(&x.out[0]) && !tb_untouched(&x.out[0]));

    /* Two outputs interleaved column by column in one allocation share no
     * element: accepted, and each gets what it gets alone. */
    int64_t both[2] = {4 * (int64_t)world, 10};
    tbuf_t mixed = tb_make(SYMM_DTYPE_BF16, 2, both, CONTIGUOUS);
    symm_tensor_t inter[2] = {x.ot[0], x.ot[1]};
    for (int i = 0; i < 2; i++) {
        inter[i].data = (uint16_t *)mixed.t.data + i;
        inter[i].strides[0] = 10;
        inter[i].strides[1] = 2;
    }
    CHECK(symm_fused_ag_mm(g, &x.at, x.bt, 2, 0, NULL, inter, NULL, NULL));
    for (int i = 0; i < 2; i++)
        for (int64_t e = 0; e < numel(&x.ot[i]); e++)
            EXPECT(*(uint16_t *)elem_ptr(&inter[i], e) == *(uint16_t *)elem_ptr(&x.ot[i], e));
    tb_free(&mixed);
    tb_free(&x.a);
    tb_free(&x.ag);
    for (int i = 0; i < 2; i++) { tb_free(&x.b[i]); tb_free(&x.out[i]); }
}

static void mm_rs_checks(symm_group_t g, int world) {
    int64_t as[2] = {2 * (int64_t)world, 6}, bs[2] = {6, 4}, os[2] = {2, 4}, odd[2] = {2 * (int64_t)world + 1, 6};
    tbuf_t a = tb_make(SYMM_DTYPE_F16, 2, as, CONTIGUOUS), b = tb_make(SYMM_DTYPE_F16, 2, bs, CONTIGUOUS);
    tbuf_t out = tb_make(SYMM_DTYPE_F16, 2, os, CONTIGUOUS), a_odd = tb_make(SYMM_DTYPE_F16, 2, odd, CONTIGUOUS);
    symm_tensor_t t;
    char want[128];
    if (world > 1) {
        snprintf(want, sizeof want, "dimension 0 of a @ b ([%d, 4]) has size %d, which the world size %d does not divide",
                 2 * world + 1, 2 * world + 1, world);
        EXPECT_FAIL(symm_mm_rs(g, &a_odd.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                    want);
    }
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, 7, &out.t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "op is 7; expected SYMM_REDUCE_SUM or SYMM_REDUCE_AVG");
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 2, SYMM_REDUCE_SUM, &out.t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "scatter_dim is 2; expected 0..1 (a has 2 dimensions)");
    t = b.t;
    t.shape[0] = 5;
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &t, 0, SYMM_REDUCE_SUM, &out.t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "b.shape[0] is 5; expected 6, a's last dimension");
    t = out.t;
    t.shape[0] = 3;
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "out.shape is [3, 4]; expected [2, 4]");
    t = out.t;
    t.data = b.t.data;
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "out overlaps b");
    EXPECT_FAIL(symm_mm_rs(g, &a.t, NULL, 0, SYMM_REDUCE_SUM, &out.t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "b is NULL");
    t = out.t;
    t.strides[0] = INT64_C(1) << 62;
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "larger than the address space");
    symm_mm_rs_options_t opts = SYMM_MM_RS_OPTIONS_INIT;
    opts.b_scale = &b.t;
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "opts->b_scale is set but a is f16");
    EXPECT(tb_untouched(&out));
    tb_free(&a);
    tb_free(&b);
    tb_free(&out);
    tb_free(&a_odd);
}

/* The options' algorithm: forced sequential and pipelined run (and give the
 * same sums), fused is refused where the kernel cannot run (the host
 * backend) on every rank, an unknown value is refused, and a caller whose
 * struct ends before the field (an older symm.h) gets the automatic choice,
 * which the plan query names. */
static void algorithm_option(symm_group_t g, int world) {
    int64_t as[2] = {2 * (int64_t)world, 6}, bs[2] = {6, 4}, os[2] = {2, 4};
    tbuf_t a = tb_make(SYMM_DTYPE_F32, 2, as, CONTIGUOUS), b = tb_make(SYMM_DTYPE_F32, 2, bs, CONTIGUOUS);
    tbuf_t out = tb_make(SYMM_DTYPE_F32, 2, os, CONTIGUOUS), first = tb_make(SYMM_DTYPE_F32, 2, os, CONTIGUOUS);
    tb_fill(&a, TAG_A, 0);
    tb_fill(&b, TAG_B, 0);
    symm_mm_rs_options_t opts = SYMM_MM_RS_OPTIONS_INIT;
    EXPECT(opts.algorithm == SYMM_ALGORITHM_AUTO);
    opts.algorithm = SYMM_ALGORITHM_SEQUENTIAL;
    CHECK(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &first.t, &opts, NULL));
    opts.algorithm = SYMM_ALGORITHM_PIPELINED;
    CHECK(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL));
    EXPECT(memcmp(out.t.data, first.t.data, 2 * 4 * sizeof(float)) == 0); /* the host backend has finished */
    if (world > 1) {
        opts.algorithm = SYMM_ALGORITHM_FUSED;
        EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL), SYMM_ERROR_UNSUPPORTED,
                    "the call's options ask for the fused algorithm, but the fused kernel cannot run this call");
    }
    opts.algorithm = 7;
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "opts->algorithm is 7; expected a SYMM_ALGORITHM_* value");
    opts.algorithm = SYMM_ALGORITHM_FUSED; /* beyond an older caller's struct: not read */
    opts.struct_size = offsetof(symm_mm_rs_options_t, algorithm);
    CHECK(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL));
    opts.struct_size = offsetof(symm_mm_rs_options_t, bias);
    EXPECT_FAIL(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, &opts, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "initialize it with SYMM_MM_RS_OPTIONS_INIT");
    symm_ag_mm_options_t ag = SYMM_AG_MM_OPTIONS_INIT;
    EXPECT(ag.algorithm == SYMM_ALGORITHM_AUTO);
    symm_plan_t p = SYMM_PLAN_INIT;
    CHECK(symm_plan_mm_rs(g, 2 * world, 6, 4, SYMM_DTYPE_F32, &p));
    const char *env = getenv("SYMM_ALGO");
    int want = !env ? SYMM_ALGORITHM_SEQUENTIAL /* a tiny call: the cost model's */
               : !strcmp(env, "pipelined") ? SYMM_ALGORITHM_PIPELINED
                                           : SYMM_ALGORITHM_SEQUENTIAL;
    EXPECT(p.algorithm == want);
    tb_free(&a);
    tb_free(&b);
    tb_free(&out);
    tb_free(&first);
}

static void lc_checks(symm_group_t g, int world) {
    int64_t is[2] = {2, 3}, os[2] = {2 * (int64_t)world, 3};
    tbuf_t in = tb_make(SYMM_DTYPE_F32, 2, is, CONTIGUOUS), out = tb_make(SYMM_DTYPE_F32, 2, os, CONTIGUOUS);
    symm_tensor_t t = out.t;
    char want[96];
    t.shape[0] = 2 * world + 2;
    snprintf(want, sizeof want, "output.shape is [%d, 3]; expected [%d, 3]", 2 * world + 2, 2 * world);
    EXPECT_FAIL(symm_lc_allgather(g, &in.t, &t, NULL), SYMM_ERROR_INVALID_ARGUMENT, want);
    t = out.t;
    t.dtype = SYMM_DTYPE_BF16;
    EXPECT_FAIL(symm_lc_allgather(g, &in.t, &t, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "output.dtype is bf16; expected f32, the dtype of input");
    t = out.t;
    t.data = (float *)in.t.data + 2;
    EXPECT_FAIL(symm_lc_allgather(g, &in.t, &t, NULL), SYMM_ERROR_INVALID_ARGUMENT, "output overlaps input");
    EXPECT_FAIL(symm_lc_allgather(g, &in.t, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT, "output is NULL");
    t = in.t;
    t.strides[0] = INT64_C(1) << 62;
    EXPECT_FAIL(symm_lc_allgather(g, &t, &out.t, NULL), SYMM_ERROR_INVALID_ARGUMENT, "larger than the address space");
    EXPECT(tb_untouched(&out));
    tb_free(&in);
    tb_free(&out);
}

/* ---- all-reduce --------------------------------------------------------- */
/* Every algorithm and dtype, strided and in place, against float64; the
 * fused rmsnorm with residual_out = residual; options, plan and errors. */
static void all_reduce_checks(symm_group_t g, int rank, int world) {
    int64_t shape[2] = {3, 5};
    int algos[3] = {SYMM_ALGORITHM_AUTO, SYMM_ALGORITHM_ONE_SHOT, SYMM_ALGORITHM_TWO_SHOT};
    int dts[3] = {SYMM_DTYPE_F32, SYMM_DTYPE_BF16, SYMM_DTYPE_F16};
    for (int a = 0; a < 3; a++)
        for (int d = 0; d < 3; d++)
            for (int layout = 0; layout < 2; layout++) {
                int dt = dts[d];
                tbuf_t in = tb_make(dt, 2, shape, layout ? PADDED : CONTIGUOUS);
                tbuf_t out = tb_make(dt, 2, shape, layout ? CONTIGUOUS : PADDED);
                tb_fill(&in, TAG_IN, rank);
                symm_all_reduce_options_t opts = SYMM_ALL_REDUCE_OPTIONS_INIT;
                opts.algorithm = algos[a];
                CHECK(symm_all_reduce(g, &in.t, &out.t, a == 0 ? SYMM_REDUCE_AVG : SYMM_REDUCE_SUM,
                                      a == 0 ? NULL : &opts, NULL));
                err_acc_t e = {0, 0};
                for (int64_t i = 0; i < 15; i++) {
                    double ref = 0;
                    for (int r = 0; r < world; r++) ref += value(dt, TAG_IN, r, i);
                    err_add(&e, tb_get(&out, i), a == 0 ? ref / world : ref);
                }
                require(err_rel(&e) <= tolerance(dt), "all-reduce result", rank);
                require(tb_outside_untouched(&out), "all-reduce wrote outside its output", rank);
                /* In place. */
                CHECK(symm_all_reduce(g, &in.t, &in.t, SYMM_REDUCE_SUM, &opts, NULL));
                e.diff2 = e.ref2 = 0;
                for (int64_t i = 0; i < 15; i++) {
                    double ref = 0;
                    for (int r = 0; r < world; r++) ref += value(dt, TAG_IN, r, i);
                    err_add(&e, tb_get(&in, i), ref);
                }
                require(err_rel(&e) <= tolerance(dt), "in-place all-reduce result", rank);
                tb_free(&in);
                tb_free(&out);
            }
    /* Fused: residual += all_reduce(x); out = rmsnorm(residual) * weight. */
    int64_t ws[1] = {5};
    tbuf_t x = tb_make(SYMM_DTYPE_F32, 2, shape, CONTIGUOUS), res = tb_make(SYMM_DTYPE_F32, 2, shape, PADDED);
    tbuf_t w = tb_make(SYMM_DTYPE_F32, 1, ws, CONTIGUOUS), out = tb_make(SYMM_DTYPE_F32, 2, shape, CONTIGUOUS);
    tb_fill(&x, TAG_IN, rank);
    tb_fill(&res, TAG_A, 0);
    tb_fill(&w, TAG_B, 0);
    CHECK(symm_all_reduce_rmsnorm(g, &x.t, &res.t, &w.t, 1e-6f, &out.t, &res.t, NULL, NULL));
    err_acc_t e = {0, 0};
    for (int t = 0; t < 3; t++) {
        double r[5], ss = 0;
        for (int i = 0; i < 5; i++) {
            r[i] = value(SYMM_DTYPE_F32, TAG_A, 0, t * 5 + i);
            for (int q = 0; q < world; q++) r[i] += value(SYMM_DTYPE_F32, TAG_IN, q, t * 5 + i);
            ss += r[i] * r[i];
            err_add(&e, tb_get(&res, t * 5 + i), r[i]);
        }
        for (int i = 0; i < 5; i++)
            err_add(&e, tb_get(&out, t * 5 + i), r[i] / sqrt(ss / 5 + 1e-6) * value(SYMM_DTYPE_F32, TAG_B, 0, i));
    }
    require(err_rel(&e) <= 1e-5, "all-reduce rmsnorm result", rank);
    /* Errors fail every rank and write nothing. */
    tbuf_t fresh = tb_make(SYMM_DTYPE_F32, 2, shape, CONTIGUOUS);
    symm_all_reduce_options_t opts = SYMM_ALL_REDUCE_OPTIONS_INIT;
    opts.algorithm = SYMM_ALGORITHM_FUSED;
    EXPECT_FAIL(symm_all_reduce(g, &x.t, &fresh.t, SYMM_REDUCE_SUM, &opts, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "opts->algorithm is 2; expected SYMM_ALGORITHM_AUTO, SYMM_ALGORITHM_ONE_SHOT or SYMM_ALGORITHM_TWO_SHOT");
    opts.algorithm = SYMM_ALGORITHM_ONE_SHOT;
    opts.struct_size = sizeof(size_t);
    EXPECT_FAIL(symm_all_reduce(g, &x.t, &fresh.t, SYMM_REDUCE_SUM, &opts, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "initialize it with SYMM_ALL_REDUCE_OPTIONS_INIT");
    EXPECT_FAIL(symm_all_reduce(g, &x.t, &fresh.t, 5, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT, "op");
    EXPECT_FAIL(symm_all_reduce_rmsnorm(g, &x.t, &res.t, &x.t, 1e-6f, &fresh.t, &res.t, NULL, NULL),
                SYMM_ERROR_INVALID_ARGUMENT, "weight.shape is [3, 5]; expected [5]");
    EXPECT(tb_untouched(&fresh));
    symm_plan_t p = SYMM_PLAN_INIT;
    CHECK(symm_plan_all_reduce(g, 4096, SYMM_DTYPE_BF16, &p));
    EXPECT(p.algorithm == SYMM_ALGORITHM_ONE_SHOT && p.total_ms > 0 && p.compute_ms == 0);
    CHECK(symm_plan_all_reduce(g, 1 << 27, SYMM_DTYPE_BF16, &p));
    EXPECT(p.algorithm == (world > 1 ? SYMM_ALGORITHM_TWO_SHOT : SYMM_ALGORITHM_ONE_SHOT));
    EXPECT_STATUS(symm_plan_all_reduce(g, 0, SYMM_DTYPE_BF16, &p), SYMM_ERROR_INVALID_ARGUMENT);
    tb_free(&x);
    tb_free(&res);
    tb_free(&w);
    tb_free(&out);
    tb_free(&fresh);
}

/* ---- integers ----------------------------------------------------------- */
/* int8, uint8, int32, int64 all-reduced exactly (values f32 and f64 would
 * round; sums that wrap; AVG truncating toward zero) by every algorithm,
 * strided and in place; gathered bit-exactly; refused by the rmsnorm, the
 * matmuls and their plans. */
static int64_t int_reference(int dt, int world, int64_t i, int avg) {
    uint64_t sum = 0;
    for (int r = 0; r < world; r++) sum += (uint64_t)int_value(dt, TAG_IN, r, i);
    int64_t wrapped = wrap_int(dt, sum);
    return avg ? wrapped / world : wrapped;
}

static void integer_checks(symm_group_t g, int rank, int world) {
    int64_t shape[2] = {3, 5};
    int algos[3] = {SYMM_ALGORITHM_AUTO, SYMM_ALGORITHM_ONE_SHOT, SYMM_ALGORITHM_TWO_SHOT};
    int dts[4] = {SYMM_DTYPE_INT8, SYMM_DTYPE_UINT8, SYMM_DTYPE_INT32, SYMM_DTYPE_INT64};
    char what[96];
    for (int d = 0; d < 4; d++) {
        int dt = dts[d];
        for (int a = 0; a < 3; a++)
            for (int layout = 0; layout < 2; layout++)
                for (int avg = 0; avg < 2; avg++) {
                    tbuf_t in = tb_make(dt, 2, shape, layout ? PADDED : CONTIGUOUS);
                    tbuf_t out = tb_make(dt, 2, shape, layout ? CONTIGUOUS : PADDED);
                    tb_fill(&in, TAG_IN, rank);
                    symm_all_reduce_options_t opts = SYMM_ALL_REDUCE_OPTIONS_INIT;
                    opts.algorithm = algos[a];
                    CHECK(symm_all_reduce(g, &in.t, &out.t, avg ? SYMM_REDUCE_AVG : SYMM_REDUCE_SUM, &opts, NULL));
                    snprintf(what, sizeof what, "%s all-reduce (algorithm %d, layout %d, avg %d)", dtype_name(dt),
                             algos[a], layout, avg);
                    for (int64_t i = 0; i < 15; i++)
                        require(load_int(dt, elem_ptr(&out.t, i)) == int_reference(dt, world, i, avg), what, rank);
                    require(tb_outside_untouched(&out), "integer all-reduce wrote outside its output", rank);
                    CHECK(symm_all_reduce(g, &in.t, &in.t, SYMM_REDUCE_SUM, &opts, NULL));
                    for (int64_t i = 0; i < 15; i++)
                        require(load_int(dt, elem_ptr(&in.t, i)) == int_reference(dt, world, i, 0),
                                "in-place integer all-reduce", rank);
                    tb_free(&in);
                    tb_free(&out);
                }
        /* The all-gather: a transposed input into a padded output. */
        int64_t gshape[2] = {3 * world, 5};
        tbuf_t in = tb_make(dt, 2, shape, TRANSPOSED), out = tb_make(dt, 2, gshape, PADDED);
        tb_fill(&in, TAG_IN, rank);
        CHECK(symm_lc_allgather(g, &in.t, &out.t, NULL));
        for (int q = 0; q < world; q++)
            for (int64_t i = 0; i < 15; i++)
                require(load_int(dt, elem_ptr(&out.t, q * 15 + i)) == int_value(dt, TAG_IN, q, i),
                        "integer lc_allgather", rank);
        require(tb_outside_untouched(&out), "integer lc_allgather wrote outside its output", rank);
        tb_free(&in);
        tb_free(&out);
    }
    /* Refusals, on every rank, writing nothing. */
    int64_t ws[1] = {5};
    tbuf_t x = tb_make(SYMM_DTYPE_INT32, 2, shape, CONTIGUOUS), res = tb_make(SYMM_DTYPE_INT32, 2, shape, CONTIGUOUS);
    tbuf_t w = tb_make(SYMM_DTYPE_INT32, 1, ws, CONTIGUOUS), out = tb_make(SYMM_DTYPE_INT32, 2, shape, CONTIGUOUS);
    tb_fill(&x, TAG_IN, rank);
    EXPECT_FAIL(symm_all_reduce_rmsnorm(g, &x.t, &res.t, &w.t, 1e-6f, &out.t, &res.t, NULL, NULL),
                SYMM_ERROR_INVALID_ARGUMENT, "input.dtype is int32; all_reduce_rmsnorm takes f32, bf16 or f16");
    EXPECT(tb_untouched(&out) && tb_untouched(&res));
    int64_t bshape[2] = {5, 5}, oshape[2] = {3 * world, 5};
    tbuf_t b = tb_make(SYMM_DTYPE_INT32, 2, bshape, CONTIGUOUS), agout = tb_make(SYMM_DTYPE_INT32, 2, oshape, CONTIGUOUS);
    symm_tensor_t bt = b.t, ot = agout.t;
    EXPECT_FAIL(symm_fused_ag_mm(g, &x.t, &bt, 1, 0, NULL, &ot, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT,
                "a_shard.dtype is int32; matmuls take f32, bf16, f16 or fp8 operands");
    EXPECT(tb_untouched(&agout));
    symm_plan_t p = SYMM_PLAN_INIT;
    CHECK(symm_plan_all_reduce(g, 4096, SYMM_DTYPE_INT64, &p));
    EXPECT(p.algorithm == SYMM_ALGORITHM_ONE_SHOT && p.total_ms > 0);
    EXPECT_FAIL(symm_plan_ag_mm(g, 64, 64, 64, SYMM_DTYPE_INT8, &p), SYMM_ERROR_INVALID_ARGUMENT,
                "dtype is int8; matmuls take");
    tb_free(&x);
    tb_free(&res);
    tb_free(&w);
    tb_free(&out);
    tb_free(&b);
    tb_free(&agout);
}

/* ---- ranks that disagree, or fail alone ------------------------------------ */
/* A fresh call (shapes no earlier call used), so no rank has it agreed. */
static symm_status_t fresh_ag_mm(symm_group_t g, int world, int rows, int gather_dim, int num_b, int dtype,
                                 tbuf_t *out0) {
    int64_t a[2] = {rows, 7}, k = gather_dim == 1 ? 7 * (int64_t)world : 7, b[2] = {k, 2},
            o[2] = {gather_dim == 1 ? rows : rows * (int64_t)world, 2};
    tbuf_t ta = tb_make(dtype, 2, a, CONTIGUOUS), tb0 = tb_make(dtype, 2, b, CONTIGUOUS),
           tb1 = tb_make(dtype, 2, b, CONTIGUOUS), to1 = tb_make(dtype, 2, o, CONTIGUOUS);
    *out0 = tb_make(dtype, 2, o, CONTIGUOUS);
    tb_fill(&ta, TAG_A, 0);
    tb_fill(&tb0, TAG_B, 0);
    tb_fill(&tb1, TAG_B, 1);
    symm_tensor_t bs[2] = {tb0.t, tb1.t}, outs[2] = {out0->t, to1.t};
    symm_status_t st = symm_fused_ag_mm(g, &ta.t, bs, num_b, gather_dim, NULL, outs, NULL, NULL);
    tb_free(&ta);
    tb_free(&tb0);
    tb_free(&tb1);
    tb_free(&to1);
    return st;
}

static void expect_mismatch(symm_status_t st, tbuf_t *out, const char *needle) {
    EXPECT_STATUS(st, SYMM_ERROR_MISMATCH);
    EXPECT_MESSAGE(needle);
    EXPECT(tb_untouched(out));
    tb_free(out);
}

static void disagreements(symm_group_t g, int rank, int world) {
    tbuf_t out;
    char want[128];
    int odd = rank == world - 1; /* the last rank differs */
    if (world < 2) return;
    snprintf(want, sizeof want, "gather_dim is 0 on rank 0 but 1 on rank %d", world - 1);
    expect_mismatch(fresh_ag_mm(g, world, 5, odd, 1, SYMM_DTYPE_F32, &out), &out, want);
    snprintf(want, sizeof want, "a_shard.shape is [6, 7] on rank 0 but [9, 7] on rank %d", world - 1);
    expect_mismatch(fresh_ag_mm(g, world, odd ? 9 : 6, 0, 1, SYMM_DTYPE_F32, &out), &out, want);
    snprintf(want, sizeof want, "num_b is 1 on rank 0 but 2 on rank %d", world - 1);
    expect_mismatch(fresh_ag_mm(g, world, 10, 0, odd ? 2 : 1, SYMM_DTYPE_F32, &out), &out, want);
    snprintf(want, sizeof want, "a_shard.dtype is f32 on rank 0 but bf16 on rank %d", world - 1);
    expect_mismatch(fresh_ag_mm(g, world, 11, 0, 1, odd ? SYMM_DTYPE_BF16 : SYMM_DTYPE_F32, &out), &out, want);

    /* mm_rs with different reduce ops. */
    int64_t as[2] = {2 * (int64_t)world, 13}, bs[2] = {13, 2}, os[2] = {2, 2};
    tbuf_t a = tb_make(SYMM_DTYPE_F32, 2, as, CONTIGUOUS), b = tb_make(SYMM_DTYPE_F32, 2, bs, CONTIGUOUS);
    out = tb_make(SYMM_DTYPE_F32, 2, os, CONTIGUOUS);
    snprintf(want, sizeof want, "op is sum on rank 0 but avg on rank %d", world - 1);
    expect_mismatch(symm_mm_rs(g, &a.t, &b.t, 0, odd ? SYMM_REDUCE_AVG : SYMM_REDUCE_SUM, &out.t, NULL, NULL), &out,
                    want);

    /* lc_allgather with the input in symmetric memory on rank 0 only. */
    symm_buffer_t buf;
    symm_handle_t h;
    int64_t is[2] = {2, 3}, ls[2] = {2 * (int64_t)world, 3};
    CHECK(symm_create(g, 4096, &buf));
    CHECK(symm_rendezvous(buf, &h));
    tbuf_t in = tb_make(SYMM_DTYPE_F32, 2, is, CONTIGUOUS);
    out = tb_make(SYMM_DTYPE_F32, 2, ls, CONTIGUOUS);
    symm_tensor_t t = in.t;
    if (rank == 0) CHECK(symm_buffer_ptr(buf, &t.data));
    expect_mismatch(symm_lc_allgather(g, &t, &out.t, NULL), &out, "input memory is symmetric buffer");
    EXPECT_MESSAGE("at offset 0 on rank 0 but ordinary memory on rank 1");
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(buf));
    tb_free(&in);

    /* One rank's call is invalid: it fails with its reason, its peers with
     * SYMM_ERROR_REMOTE naming it, and nobody writes anything. */
    out = tb_make(SYMM_DTYPE_F32, 2, os, CONTIGUOUS);
    t = out.t;
    if (odd) t.shape[1] = 3;
    symm_status_t st = symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &t, NULL, NULL);
    if (odd) {
        EXPECT_STATUS(st, SYMM_ERROR_INVALID_ARGUMENT);
        EXPECT_MESSAGE("out.shape is [2, 3]; expected [2, 2]");
    } else {
        EXPECT_STATUS(st, SYMM_ERROR_REMOTE);
        snprintf(want, sizeof want, "rank %d: out.shape is [2, 3]; expected [2, 2]", world - 1);
        EXPECT_MESSAGE(want);
    }
    EXPECT(tb_untouched(&out));

    /* A binding that checks its arguments itself refuses its call with its
     * own reason (symm_refuse_call); the peers quote that reason. */
    if (odd) {
        EXPECT_STATUS(symm_refuse_call(g, "mm_rs", "the binding's reason", NULL), SYMM_ERROR_INVALID_ARGUMENT);
        EXPECT_MESSAGE("the binding's reason");
    } else {
        EXPECT_STATUS(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, NULL, NULL), SYMM_ERROR_REMOTE);
        snprintf(want, sizeof want, "rank %d: the binding's reason", world - 1);
        EXPECT_MESSAGE(want);
        EXPECT(tb_untouched(&out));
    }
    /* An operation symm does not have enters no call: this rank alone fails. */
    EXPECT_STATUS(symm_refuse_call(g, "matmul", "x", NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("operation is \"matmul\"");

    /* Workspace reservations must agree too. */
    EXPECT_STATUS(symm_group_reserve_workspace(g, odd ? 3u << 20 : 2u << 20), SYMM_ERROR_MISMATCH);
    EXPECT_MESSAGE("the ranks reserve different workspace sizes");

    /* After all that, the group still works. */
    tb_fill(&a, TAG_A, rank);
    tb_fill(&b, TAG_B, rank);
    CHECK(symm_mm_rs(g, &a.t, &b.t, 0, SYMM_REDUCE_SUM, &out.t, NULL, NULL));
    EXPECT(!tb_untouched(&out) && tb_outside_untouched(&out));
    tb_free(&a);
    tb_free(&b);
    tb_free(&out);
}

/* With SYMM_CHECK_ARGS=always, a call agreed before is checked again. */
static void disagreement_after_agreement(symm_group_t g, int rank, int world) {
    tbuf_t out;
    char want[96];
    if (world < 2) return;
    CHECK(fresh_ag_mm(g, world, 12, 0, 1, SYMM_DTYPE_F32, &out));
    tb_free(&out);
    CHECK(fresh_ag_mm(g, world, 12, 1, 1, SYMM_DTYPE_F32, &out));
    tb_free(&out);
    snprintf(want, sizeof want, "gather_dim is 0 on rank 0 but 1 on rank %d", world - 1);
    expect_mismatch(fresh_ag_mm(g, world, 12, rank == world - 1, 1, SYMM_DTYPE_F32, &out), &out, want);
}

static int rank_main(symm_group_t g, int rank, int world) {
    CHECK(symm_group_reserve_workspace(g, 1u << 20));
    ag_mm_results(g, rank, world);
    mm_rs_results(g, rank, world);
    lc_results(g, rank, world);
    ag_mm_checks(g, world);
    mm_rs_checks(g, world);
    algorithm_option(g, world);
    lc_checks(g, world);
    all_reduce_checks(g, rank, world);
    integer_checks(g, rank, world);
    disagreements(g, rank, world);
    const char *check_args = getenv("SYMM_CHECK_ARGS");
    if (check_args && !strcmp(check_args, "always")) disagreement_after_agreement(g, rank, world);
    return 0;
}

int main(int argc, char **argv) { return harness_main(argc, argv, rank_main); }
