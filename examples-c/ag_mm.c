/*
 * Fused all-gather + matmul (tensor parallelism's column-parallel layer):
 * rank r holds rows 4r..4r+3 of A [4 * world, 8] and its own B [8, 6];
 * symm_fused_ag_mm gives every rank the gathered A and A @ B, which this
 * checks against a plain triple loop.
 *
 *   SYMM_BACKEND=host ./ag_mm --world-size 4
 */
#include "launch.h"

#include <math.h>

enum { ROWS = 4, K = 8, N = 6 };

static float a_value(int row, int k) { return (float)sin(0.7 * row + 0.3 * k); }
static float b_value(int rank, int k, int n) { return (float)cos(0.5 * k - 0.2 * n + rank); }

static int run(symm_group_t group, int rank, int world) {
    int backend;
    CHECK(symm_group_backend(group, &backend));
    if (backend != SYMM_BACKEND_HOST) {
        printf("rank %d: this example keeps its tensors in host memory; run it with SYMM_BACKEND=host\n", rank);
        return 0;
    }
    float shard[ROWS][K], b[K][N];
    float *gathered = malloc(sizeof(float) * ROWS * world * K), *out = malloc(sizeof(float) * ROWS * world * N);
    for (int i = 0; i < ROWS; i++)
        for (int k = 0; k < K; k++) shard[i][k] = a_value(rank * ROWS + i, k);
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++) b[k][n] = b_value(rank, k, n);

    /* Tensors describe the caller's memory: data, dtype, shape (strides too,
     * for non-contiguous ones; this helper fills row-major strides). */
    int64_t shard_shape[2] = {ROWS, K}, b_shape[2] = {K, N};
    int64_t gathered_shape[2] = {ROWS * (int64_t)world, K}, out_shape[2] = {ROWS * (int64_t)world, N};
    symm_tensor_t a_t = symm_tensor_contiguous(shard, SYMM_DTYPE_F32, 2, shard_shape);
    symm_tensor_t b_t = symm_tensor_contiguous(b, SYMM_DTYPE_F32, 2, b_shape);
    symm_tensor_t ag_t = symm_tensor_contiguous(gathered, SYMM_DTYPE_F32, 2, gathered_shape);
    symm_tensor_t out_t = symm_tensor_contiguous(out, SYMM_DTYPE_F32, 2, out_shape);

    /* Collective: one B here (pass an array for several), gathered along
     * dimension 0, the gathered A wanted too, default options, default stream. */
    CHECK(symm_fused_ag_mm(group, &a_t, &b_t, 1, /*gather_dim=*/0, &ag_t, &out_t, NULL, NULL));

    double worst = 0;
    for (int i = 0; i < ROWS * world; i++)
        for (int n = 0; n < N; n++) {
            double ref = 0;
            for (int k = 0; k < K; k++) {
                ref += (double)a_value(i, k) * b[k][n];
                if (n == 0 && gathered[i * K + k] != a_value(i, k)) worst = INFINITY;
            }
            worst = fmax(worst, fabs(out[i * N + n] - ref));
        }
    int ok = worst < 1e-5;
    printf("rank %d of %d: all_gather(A) @ B = [%d x %d], max error %.1e: %s\n", rank, world, ROWS * world, N, worst,
           ok ? "ok" : "WRONG");
    free(gathered);
    free(out);
    return ok ? 0 : 1;
}

int main(int argc, char **argv) { return example_main(argc, argv, run); }
