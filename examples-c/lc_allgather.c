/*
 * Low-contention all-gather: each rank writes 3 rows of 4 values into a
 * symmetric buffer, and symm_lc_allgather gathers every rank's rows into an
 * ordinary [3 * world, 4] array. Because the input lies in a rendezvoused
 * buffer (at the same offset on every rank), the peers read it in place;
 * an input in ordinary memory works too and is first staged in symm's
 * workspace.
 *
 *   SYMM_BACKEND=host ./lc_allgather --world-size 4
 */
#include "launch.h"

enum { ROWS = 3, COLS = 4 };

static int run(symm_group_t group, int rank, int world) {
    int backend;
    CHECK(symm_group_backend(group, &backend));
    if (backend != SYMM_BACKEND_HOST) {
        printf("rank %d: this example fills its input from the CPU; run it with SYMM_BACKEND=host\n", rank);
        return 0;
    }
    symm_buffer_t buf;
    symm_handle_t h;
    int32_t *mine;
    CHECK(symm_create(group, ROWS * COLS * sizeof(int32_t), &buf));
    CHECK(symm_rendezvous(buf, &h)); /* collective: now symm knows the buffer is symmetric */
    CHECK(symm_buffer_ptr(buf, (void **)&mine));
    for (int i = 0; i < ROWS * COLS; i++) mine[i] = 100 * rank + i;

    /* Any 32-bit element type moves the same bits; this uses f32's. */
    int32_t *out = malloc(sizeof(int32_t) * ROWS * COLS * world);
    int64_t in_shape[2] = {ROWS, COLS}, out_shape[2] = {ROWS * (int64_t)world, COLS};
    symm_tensor_t in_t = symm_tensor_contiguous(mine, SYMM_DTYPE_F32, 2, in_shape);
    symm_tensor_t out_t = symm_tensor_contiguous(out, SYMM_DTYPE_F32, 2, out_shape);
    CHECK(symm_lc_allgather(group, &in_t, &out_t, NULL));

    int ok = 1;
    for (int r = 0; r < world; r++)
        for (int i = 0; i < ROWS * COLS; i++) ok &= out[r * ROWS * COLS + i] == 100 * r + i;
    printf("rank %d of %d: gathered [%d x %d] from every rank's symmetric buffer: %s\n", rank, world, ROWS * world,
           COLS, ok ? "ok" : "WRONG");
    free(out);
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(buf));
    return ok ? 0 : 1;
}

int main(int argc, char **argv) { return example_main(argc, argv, run); }
