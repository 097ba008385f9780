/*
 * Fused matmul + reduce-scatter (tensor parallelism's row-parallel layer):
 * rank r holds columns 4r..4r+3 of A [2 * world, 4 * world] and the
 * matching rows of B [4 * world, 5]. Each rank's product A_r @ B_r is a
 * partial sum of A @ B; symm_mm_rs sums them over the ranks and gives rank
 * r its 2 rows of the result, which this checks against a plain loop.
 *
 *   SYMM_BACKEND=host ./mm_rs --world-size 4
 */
#include "launch.h"

#include <math.h>

enum { ROWS_PER_RANK = 2, K_PER_RANK = 4, N = 5 };

static float a_value(int row, int k) { return (float)sin(0.3 * row - 0.4 * k); }
static float b_value(int k, int n) { return (float)cos(0.6 * k + 0.1 * n); }

static int run(symm_group_t group, int rank, int world) {
    int backend;
    CHECK(symm_group_backend(group, &backend));
    if (backend != SYMM_BACKEND_HOST) {
        printf("rank %d: this example keeps its tensors in host memory; run it with SYMM_BACKEND=host\n", rank);
        return 0;
    }
    int m = ROWS_PER_RANK * world;
    float *a = malloc(sizeof(float) * m * K_PER_RANK), b[K_PER_RANK][N], out[ROWS_PER_RANK][N];
    for (int i = 0; i < m; i++)
        for (int k = 0; k < K_PER_RANK; k++) a[i * K_PER_RANK + k] = a_value(i, rank * K_PER_RANK + k);
    for (int k = 0; k < K_PER_RANK; k++)
        for (int n = 0; n < N; n++) b[k][n] = b_value(rank * K_PER_RANK + k, n);

    int64_t a_shape[2] = {m, K_PER_RANK}, b_shape[2] = {K_PER_RANK, N}, out_shape[2] = {ROWS_PER_RANK, N};
    symm_tensor_t a_t = symm_tensor_contiguous(a, SYMM_DTYPE_F32, 2, a_shape);
    symm_tensor_t b_t = symm_tensor_contiguous(b, SYMM_DTYPE_F32, 2, b_shape);
    symm_tensor_t out_t = symm_tensor_contiguous(out, SYMM_DTYPE_F32, 2, out_shape);

    /* Collective: scatter the rows (dimension 0) of the summed product. */
    CHECK(symm_mm_rs(group, &a_t, &b_t, /*scatter_dim=*/0, SYMM_REDUCE_SUM, &out_t, NULL, NULL));

    double worst = 0;
    for (int i = 0; i < ROWS_PER_RANK; i++)
        for (int n = 0; n < N; n++) {
            double ref = 0;
            for (int k = 0; k < K_PER_RANK * world; k++) ref += (double)a_value(rank * ROWS_PER_RANK + i, k) * b_value(k, n);
            worst = fmax(worst, fabs(out[i][n] - ref));
        }
    int ok = worst < 1e-5;
    printf("rank %d of %d: rows %d..%d of sum(A_r @ B_r), max error %.1e: %s\n", rank, world, rank * ROWS_PER_RANK,
           (rank + 1) * ROWS_PER_RANK - 1, worst, ok ? "ok" : "WRONG");
    free(a);
    return ok ? 0 : 1;
}

int main(int argc, char **argv) { return example_main(argc, argv, run); }
