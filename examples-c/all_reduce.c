/*
 * All-reduce, alone and fused with the residual add and RMSNorm that follow
 * attention and the MLP in an inference engine: rank r holds a partial
 * [TOKENS, HIDDEN] activation; symm_all_reduce sums them over the ranks in
 * place, and symm_all_reduce_rmsnorm does `residual += all_reduce(x); out =
 * rmsnorm(residual) * weight` in one call (with residual_out = residual).
 * Both are checked against plain loops. symm_plan_all_reduce says which
 * algorithm (one-shot or two-shot) a size gets.
 *
 *   SYMM_BACKEND=host ./all_reduce --world-size 4
 */
#include "launch.h"

#include <math.h>

enum { TOKENS = 3, HIDDEN = 16 };

static float x_value(int rank, int i) { return (float)sin(0.7 * i + rank); }

static int run(symm_group_t group, int rank, int world) {
    int backend;
    CHECK(symm_group_backend(group, &backend));
    if (backend != SYMM_BACKEND_HOST) {
        printf("rank %d: this example keeps its tensors in host memory; run it with SYMM_BACKEND=host\n", rank);
        return 0;
    }
    enum { N = TOKENS * HIDDEN };
    float x[N], residual[N], weight[HIDDEN], out[N], sum[N];
    for (int i = 0; i < N; i++) {
        x[i] = x_value(rank, i);
        residual[i] = 0.01f * (float)i;
        sum[i] = 0;
        for (int r = 0; r < world; r++) sum[i] += x_value(r, i);
    }
    for (int i = 0; i < HIDDEN; i++) weight[i] = 1.0f + 0.1f * (float)i;
    int64_t shape[2] = {TOKENS, HIDDEN}, wshape[1] = {HIDDEN};
    symm_tensor_t x_t = symm_tensor_contiguous(x, SYMM_DTYPE_F32, 2, shape);
    symm_tensor_t res_t = symm_tensor_contiguous(residual, SYMM_DTYPE_F32, 2, shape);
    symm_tensor_t w_t = symm_tensor_contiguous(weight, SYMM_DTYPE_F32, 1, wshape);
    symm_tensor_t out_t = symm_tensor_contiguous(out, SYMM_DTYPE_F32, 2, shape);

    /* Fused: residual += all_reduce(x); out = rmsnorm(residual) * weight. */
    CHECK(symm_all_reduce_rmsnorm(group, &x_t, &res_t, &w_t, 1e-6f, &out_t, &res_t, NULL, NULL));
    double worst = 0;
    for (int t = 0; t < TOKENS; t++) {
        double ss = 0, r[HIDDEN];
        for (int i = 0; i < HIDDEN; i++) {
            r[i] = sum[t * HIDDEN + i] + 0.01 * (t * HIDDEN + i);
            ss += r[i] * r[i];
        }
        double inv = 1 / sqrt(ss / HIDDEN + 1e-6);
        for (int i = 0; i < HIDDEN; i++) {
            worst = fmax(worst, fabs(residual[t * HIDDEN + i] - r[i]));
            worst = fmax(worst, fabs(out[t * HIDDEN + i] - r[i] * inv * weight[i]));
        }
    }

    /* Alone, in place (output is input), forcing the two-shot algorithm. */
    symm_all_reduce_options_t opts = SYMM_ALL_REDUCE_OPTIONS_INIT;
    opts.algorithm = SYMM_ALGORITHM_TWO_SHOT;
    CHECK(symm_all_reduce(group, &x_t, &x_t, SYMM_REDUCE_SUM, &opts, NULL));
    for (int i = 0; i < N; i++) worst = fmax(worst, fabs(x[i] - sum[i]));

    symm_plan_t small = SYMM_PLAN_INIT, large = SYMM_PLAN_INIT;
    CHECK(symm_plan_all_reduce(group, 4096, SYMM_DTYPE_BF16, &small));
    CHECK(symm_plan_all_reduce(group, 64 << 20, SYMM_DTYPE_BF16, &large));
    int ok = worst < 1e-4 && (world == 1 || (small.algorithm == SYMM_ALGORITHM_ONE_SHOT &&
                                             large.algorithm == SYMM_ALGORITHM_TWO_SHOT));
    printf("rank %d of %d: all-reduce + rmsnorm of [%d x %d], max error %.1e; 8 KB %s, 128 MB %s: %s\n", rank,
           world, TOKENS, HIDDEN, worst, small.algorithm == SYMM_ALGORITHM_ONE_SHOT ? "one-shot" : "two-shot",
           large.algorithm == SYMM_ALGORITHM_ONE_SHOT ? "one-shot" : "two-shot", ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
}

int main(int argc, char **argv) { return example_main(argc, argv, run); }
