/*
 * Symmetric buffers, rendezvous and signals: every rank allocates the same
 * buffer, maps everyone's, writes a greeting into its right neighbour's copy,
 * signals it, and reads the greeting its left neighbour left.
 *
 *   ./signals --world-size 4
 */
#include "launch.h"

static int run(symm_group_t group, int rank, int world) {
    symm_buffer_t buf;
    symm_handle_t h;
    CHECK(symm_create(group, 4096, &buf)); /* same size on every rank */
    CHECK(symm_rendezvous(buf, &h));       /* collective: maps every peer's copy */

    int right = (rank + 1) % world, left = (rank + world - 1) % world;
    char *theirs, *mine;
    CHECK(symm_handle_peer_ptr(h, right, (void **)&theirs));
    CHECK(symm_buffer_ptr(buf, (void **)&mine));

    /* On the CUDA backend these pointers are device pointers: write them from
     * a kernel or with cudaMemcpy; on the host backend they are plain memory. */
    int backend;
    CHECK(symm_group_backend(group, &backend));
    if (backend == SYMM_BACKEND_HOST && world > 1) {
        snprintf(theirs, 64, "hello from rank %d", rank);
        CHECK(symm_put_signal(h, right, 0, NULL)); /* releases the write */
        CHECK(symm_wait_signal(h, left, 0, NULL)); /* acquires the left's */
        printf("rank %d of %d got \"%s\"\n", rank, world, mine);
    }
    CHECK(symm_barrier(h, 1, NULL)); /* no one unmaps while others write */
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(buf));
    return 0;
}

int main(int argc, char **argv) { return example_main(argc, argv, run); }
