/*
 * Symmetric memory across ranks: data written through peer pointers is seen
 * by the peer after a barrier, signals between chosen pairs, sizes that
 * differ between ranks fail on every rank, and a rank that skips a barrier
 * is named by the others' timeout.
 */
#include "harness.h"

#define N 4096 /* uint32 elements per rank */

static void all_ranks_write_to_all(symm_handle_t h, int rank, int world) {
    /* Rank r writes value (r << 16 | i) into slot r of every peer's buffer. */
    for (int p = 0; p < world; p++) {
        uint32_t *peer;
        CHECK(symm_handle_peer_ptr(h, p, (void **)&peer));
        for (int i = 0; i < N / world; i++) peer[rank * (N / world) + i] = ((uint32_t)rank << 16) | (uint32_t)i;
    }
    CHECK(symm_barrier(h, 0, NULL));
    uint32_t *mine;
    CHECK(symm_handle_peer_ptr(h, rank, (void **)&mine));
    for (int r = 0; r < world; r++)
        for (int i = 0; i < N / world; i++) EXPECT(mine[r * (N / world) + i] == (((uint32_t)r << 16) | (uint32_t)i));
    CHECK(symm_barrier(h, 0, NULL)); /* nobody writes the next round before all have read */
}

static void ring_signals(symm_handle_t h, int rank, int world) {
    /* Each rank passes a token to rank+1 through its buffer and a signal on
     * channel 5; the receiver checks the token arrived with the signal and
     * acknowledges on channel 6 before the sender may overwrite it. */
    if (world < 2) return;
    int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    uint32_t *peer, *mine;
    CHECK(symm_handle_peer_ptr(h, next, (void **)&peer));
    CHECK(symm_handle_peer_ptr(h, rank, (void **)&mine));
    for (int round = 1; round <= 50; round++) {
        if (round > 1) CHECK(symm_wait_signal(h, next, 6, NULL));
        peer[N - 1 - rank] = 1000u * (uint32_t)round + (uint32_t)rank;
        CHECK(symm_put_signal(h, next, 5, NULL));
        CHECK(symm_wait_signal(h, prev, 5, NULL));
        EXPECT(mine[N - 1 - prev] == 1000u * (uint32_t)round + (uint32_t)prev);
        CHECK(symm_put_signal(h, prev, 6, NULL));
    }
    CHECK(symm_wait_signal(h, next, 6, NULL));
    /* Only rank 0 -> last rank, on channel 7: other pairs stay silent. */
    if (rank == 0) CHECK(symm_put_signal(h, world - 1, 7, NULL));
    if (rank == world - 1) CHECK(symm_wait_signal(h, 0, 7, NULL));
    CHECK(symm_barrier(h, 1, NULL));
}

static void mismatched_sizes(symm_group_t g, int rank, int world) {
    if (world < 2) return;
    symm_buffer_t b;
    CHECK(symm_create(g, 4096 + (rank == world - 1 ? 8 : 0), &b));
    symm_handle_t h = (symm_handle_t)0x1234; /* must stay untouched */
    EXPECT_STATUS(symm_rendezvous(b, &h), SYMM_ERROR_MISMATCH);
    EXPECT_MESSAGE("sizes differ");
    EXPECT(h == (symm_handle_t)0x1234);
    CHECK(symm_buffer_destroy(b));
}

static void peer_skips_barrier(symm_group_t g, symm_handle_t h, int rank, int world) {
    /* Rank world-1 does not enter this barrier: everyone else must time out
     * naming it (or stop at once when a peer timed out first, naming it
     * too); then the group has failed on every rank, world-1 included, and
     * refuses every call until destroyed. */
    if (world < 2) return;
    CHECK(symm_group_set_timeout(g, 300));
    char needle[32];
    snprintf(needle, sizeof needle, "rank %d did not arrive", world - 1);
    symm_status_t health = SYMM_SUCCESS;
    if (rank != world - 1) {
        symm_status_t st = symm_barrier(h, 2, NULL);
        EXPECT(st == SYMM_ERROR_TIMEOUT || st == SYMM_ERROR_REMOTE);
        EXPECT_MESSAGE(needle);
    }
    for (int i = 0; i < 5000 && health == SYMM_SUCCESS; i++) {
        CHECK(symm_group_health(g, &health));
        if (health == SYMM_SUCCESS) usleep(1000);
    }
    EXPECT(health == SYMM_ERROR_TIMEOUT || health == SYMM_ERROR_REMOTE);
    EXPECT_MESSAGE(needle);
    EXPECT_STATUS(symm_barrier(h, 2, NULL), SYMM_ERROR_ABORTED);
    EXPECT_MESSAGE("no longer usable");
    EXPECT_STATUS(symm_group_reserve_workspace(g, 4096), SYMM_ERROR_ABORTED);
    symm_buffer_t b;
    EXPECT_STATUS(symm_create(g, 4096, &b), SYMM_ERROR_ABORTED);
}

static int rank_main(symm_group_t g, int rank, int world) {
    int r, w, backend;
    CHECK(symm_group_rank(g, &r));
    CHECK(symm_group_world_size(g, &w));
    CHECK(symm_group_backend(g, &backend));
    EXPECT(r == rank && w == world && backend == SYMM_BACKEND_HOST);

    symm_buffer_t b;
    symm_handle_t h;
    CHECK(symm_create(g, N * sizeof(uint32_t), &b));
    size_t size;
    CHECK(symm_buffer_size(b, &size));
    EXPECT(size == N * sizeof(uint32_t));
    uint32_t *mine;
    CHECK(symm_buffer_ptr(b, (void **)&mine));
    for (int i = 0; i < N; i++) EXPECT(mine[i] == 0); /* fresh memory is zeroed */
    CHECK(symm_rendezvous(b, &h));
    void *self_ptr;
    CHECK(symm_handle_peer_ptr(h, rank, &self_ptr));
    EXPECT(self_ptr == mine);
    EXPECT_STATUS(symm_handle_peer_ptr(h, world, &self_ptr), SYMM_ERROR_INVALID_ARGUMENT);

    for (int round = 0; round < 3; round++) all_ranks_write_to_all(h, rank, world);
    ring_signals(h, rank, world);
    mismatched_sizes(g, rank, world);

    peer_skips_barrier(g, h, rank, world);

    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(b));
    return 0;
}

int main(int argc, char **argv) {
    return harness_main(argc, argv, rank_main);
}
