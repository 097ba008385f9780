// GPU tests of symmetric memory, rendezvous and signals on the CUDA backend.
// Built on the GPU machine by bench/gpu/run.sh (nvcc + libsymm.so), run as
// several processes (one launcher forks the ranks) or several ranks in one
// process. Prints "ok"/"FAIL" lines and JSON measurement records.
//
//   cuda_memory --world-size N [--shared-device] [--local] [--bench]
#include <cuda_runtime.h>

#include <algorithm>
#include <pthread.h>
#include <stdint.h>
#include <vector>

#include "launch.h"

#define CUDA_CHECK(call)                                                                     \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

#define EXPECT(cond)                                                                         \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: rank %d: expected %s\n", __FILE__, __LINE__, g_rank, #cond); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

static __thread int g_rank = -1;
static int g_bench = 0;

// Ranks that share one device inside one process share its context: a
// device-synchronizing call (cudaMalloc, cudaFree, ...) by one rank waits
// for a peer's signal kernel, which may wait for this rank: a deadlock until
// the timeout. Such ranks separate allocation phases from signalling ones.
static int g_local = 0;
static pthread_barrier_t g_phase;
static void phase(void) {
    if (g_local) pthread_barrier_wait(&g_phase);
}

static __device__ uint32_t value_of(int rank, uint32_t i, uint32_t round) { return (uint32_t)rank * 0x01000193u ^ (i * 2654435761u) ^ round; }

// Rank `rank` writes its chunk of every peer's buffer (all peers' pointers in `peers`).
__global__ void write_to_peers(uint32_t **peers, int world, int rank, uint32_t chunk, uint32_t round) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < chunk; i += gridDim.x * blockDim.x)
        for (int p = 0; p < world; p++) peers[p][rank * chunk + i] = value_of(rank, i, round);
}

__global__ void count_wrong(const uint32_t *mine, int world, uint32_t chunk, uint32_t round, unsigned *wrong) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < chunk; i += gridDim.x * blockDim.x)
        for (int r = 0; r < world; r++)
            if (mine[r * chunk + i] != value_of(r, i, round)) atomicAdd(wrong, 1u);
}

__global__ void write_token(uint32_t *p, uint32_t v) { *p = v; }
__global__ void check_token(const volatile uint32_t *p, uint32_t v, unsigned *wrong) {
    if (*p != v) atomicAdd(wrong, 1u);
}

typedef struct {
    symm_group_t g;
    int rank, world, device;
} ctx_t;

static void data_through_peers(ctx_t *c, cudaStream_t s) {
    const uint32_t chunk = 1 << 20; // 4 MiB per rank
    symm_buffer_t b;
    symm_handle_t h;
    CHECK(symm_create(c->g, (size_t)chunk * c->world * 4, &b));
    CHECK(symm_rendezvous(b, &h));
    std::vector<uint32_t *> peers(c->world);
    for (int p = 0; p < c->world; p++) CHECK(symm_handle_peer_ptr(h, p, (void **)&peers[p]));
    uint32_t **dpeers;
    unsigned *wrong;
    CUDA_CHECK(cudaMalloc(&dpeers, c->world * sizeof(void *)));
    CUDA_CHECK(cudaMalloc(&wrong, sizeof(unsigned)));
    // Async on our stream: a plain cudaMemcpy from pageable memory may return
    // before the DMA lands, and `s` (non-blocking) would not wait for it.
    CUDA_CHECK(cudaMemcpyAsync(dpeers, peers.data(), c->world * sizeof(void *), cudaMemcpyHostToDevice, s));
    phase();
    for (uint32_t round = 1; round <= 20; round++) {
        CUDA_CHECK(cudaMemsetAsync(wrong, 0, sizeof(unsigned), s));
        write_to_peers<<<64, 256, 0, s>>>(dpeers, c->world, c->rank, chunk, round);
        CHECK(symm_barrier(h, 0, s));
        count_wrong<<<64, 256, 0, s>>>(peers[c->rank], c->world, chunk, round, wrong);
        CHECK(symm_barrier(h, 1, s)); // nobody writes round+1 before all checked round
        unsigned w;
        CUDA_CHECK(cudaMemcpyAsync(&w, wrong, sizeof w, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        if (w != 0) {
            symm_status_t st = symm_group_check_async_error(c->g);
            fprintf(stderr, "rank %d round %u: %u of %u words wrong (async: %s %s)\n", c->rank, round, w,
                    chunk * c->world, symm_status_string(st), st ? symm_last_error() : "");
        }
        EXPECT(w == 0);
    }
    CHECK(symm_group_check_async_error(c->g));
    phase();
    CUDA_CHECK(cudaFree(dpeers));
    CUDA_CHECK(cudaFree(wrong));
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(b));
    if (c->rank == 0) printf("ok data_through_peers world=%d\n", c->world);
}

static void ring_signals_and_flags(ctx_t *c, cudaStream_t s) {
    if (c->world < 2) return;
    symm_buffer_t b;
    symm_handle_t h;
    CHECK(symm_create(c->g, 4096, &b));
    CHECK(symm_rendezvous(b, &h));
    int next = (c->rank + 1) % c->world, prev = (c->rank + c->world - 1) % c->world;
    uint32_t *peer_next, *mine;
    unsigned *wrong;
    CHECK(symm_handle_peer_ptr(h, next, (void **)&peer_next));
    CHECK(symm_handle_peer_ptr(h, c->rank, (void **)&mine));
    CUDA_CHECK(cudaMalloc(&wrong, sizeof(unsigned)));
    CUDA_CHECK(cudaMemsetAsync(wrong, 0, sizeof(unsigned), s));
    phase();
    for (uint32_t round = 1; round <= 100; round++) {
        if (round > 1) CHECK(symm_wait_signal(h, next, 6, s)); // next consumed our last token
        write_token<<<1, 1, 0, s>>>(peer_next + c->rank, 1000 * round + c->rank);
        CHECK(symm_put_signal(h, next, 5, s));
        CHECK(symm_wait_signal(h, prev, 5, s));
        check_token<<<1, 1, 0, s>>>(mine + prev, 1000 * round + prev, wrong);
        CHECK(symm_put_signal(h, prev, 6, s));
    }
    CHECK(symm_wait_signal(h, next, 6, s));
    // Progress flags: each rank raises a counter in its right neighbour's
    // buffer; the neighbour's stream waits for it.
    for (uint32_t v = 1; v <= 10; v++) {
        CHECK(symm_write_value(h, next, 2048, v, s));
        CHECK(symm_wait_value(h, c->rank, 2048, v, s));
    }
    CHECK(symm_barrier(h, 0, s));
    unsigned w;
    CUDA_CHECK(cudaMemcpyAsync(&w, wrong, sizeof w, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    CHECK(symm_group_check_async_error(c->g));
    EXPECT(w == 0);
    phase();
    CUDA_CHECK(cudaFree(wrong));
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(b));
    if (c->rank == 0) printf("ok ring_signals_and_flags world=%d\n", c->world);
}

static void graph_replayed_barrier(ctx_t *c, cudaStream_t s) {
    symm_buffer_t b;
    symm_handle_t h;
    CHECK(symm_create(c->g, 4096, &b));
    CHECK(symm_rendezvous(b, &h));
    const int per_graph = 100, replays = 10; // 1,000 barriers in all
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < per_graph; i++) CHECK(symm_barrier(h, 3, s));
    CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    phase();
    CUDA_CHECK(cudaGraphLaunch(exec, s)); // warm up
    CUDA_CHECK(cudaStreamSynchronize(s));
    CUDA_CHECK(cudaEventRecord(e0, s));
    for (int r = 0; r < replays; r++) CUDA_CHECK(cudaGraphLaunch(exec, s));
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    CHECK(symm_group_check_async_error(c->g));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    phase();
    // Pads are back to zero after balanced barriers (waiters reset them).
    std::vector<uint32_t> pad(16 * c->world);
    void *mypad;
    CHECK(symm_handle_signal_pad_ptr(h, c->rank, &mypad));
    CUDA_CHECK(cudaMemcpy(pad.data(), mypad, pad.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < pad.size(); i++) EXPECT(pad[i] == 0);
    printf("{\"op\": \"barrier\", \"shape\": [0], \"impl\": \"symm\", \"world\": %d, \"rank\": %d, \"us_per_barrier\": %.3f, "
           "\"iters\": %d}\n",
           c->world, c->rank, 1000.0 * ms / (per_graph * replays), per_graph * replays);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(b));
    if (c->rank == 0) printf("ok graph_replayed_barrier world=%d (1000 replays)\n", c->world);
}

static void peer_copy_bandwidth(ctx_t *c, cudaStream_t s) {
    if (c->world < 2) return;
    const size_t bytes = 256ull << 20;
    symm_buffer_t b;
    symm_handle_t h;
    CHECK(symm_create(c->g, bytes, &b));
    CHECK(symm_rendezvous(b, &h));
    void *peer, *dst;
    CHECK(symm_handle_peer_ptr(h, (c->rank + 1) % c->world, &peer));
    CUDA_CHECK(cudaMalloc(&dst, bytes));
    phase();
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> times;
    for (int i = 0; i < 23; i++) {
        CHECK(symm_barrier(h, 0, s));
        CUDA_CHECK(cudaEventRecord(e0, s));
        CUDA_CHECK(cudaMemcpyAsync(dst, peer, bytes, cudaMemcpyDeviceToDevice, s)); // copy engine pull
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3) times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    float med = times[times.size() / 2];
    printf("{\"op\": \"peer_copy\", \"shape\": [%zu], \"impl\": \"symm\", \"world\": %d, \"rank\": %d, \"ms\": %.4f, "
           "\"GBps\": %.1f, \"iters\": %zu}\n",
           bytes, c->world, c->rank, med, bytes / (med * 1e6), times.size());
    CHECK(symm_barrier(h, 0, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    phase();
    CUDA_CHECK(cudaFree(dst));
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(b));
}

static void no_leak(ctx_t *c) {
    size_t free0, free1, total;
    for (int i = 0; i < 10; i++) { // warm up lazy state
        symm_buffer_t b; symm_handle_t h;
        CHECK(symm_create(c->g, 1 << 20, &b)); CHECK(symm_rendezvous(b, &h));
        CHECK(symm_handle_destroy(h)); CHECK(symm_buffer_destroy(b));
    }
    CUDA_CHECK(cudaMemGetInfo(&free0, &total));
    for (int i = 0; i < 1000; i++) {
        symm_buffer_t b; symm_handle_t h;
        CHECK(symm_create(c->g, 1 << 20, &b)); CHECK(symm_rendezvous(b, &h));
        CHECK(symm_handle_destroy(h)); CHECK(symm_buffer_destroy(b));
    }
    CUDA_CHECK(cudaMemGetInfo(&free1, &total));
    // Other ranks may share this device and be mid-round: allow a few buffers.
    EXPECT(free1 + (64ull << 20) >= free0);
    if (c->rank == 0) printf("ok no_leak 1000 rounds (free %zu -> %zu MiB)\n", free0 >> 20, free1 >> 20);
}

static void skipped_barrier_times_out(ctx_t *c, cudaStream_t s) {
    // Last: the pads are undefined after a timeout. The last rank never
    // enters; everyone else's kernel gives up and the host names the rank.
    if (c->world < 2) return;
    symm_buffer_t b;
    symm_handle_t h;
    CHECK(symm_create(c->g, 4096, &b));
    CHECK(symm_rendezvous(b, &h));
    CHECK(symm_group_set_timeout(c->g, 500));
    if (c->rank != c->world - 1) {
        CHECK(symm_barrier(h, 9, s));
        CUDA_CHECK(cudaStreamSynchronize(s)); // returns: the kernel gave up
        symm_status_t st = symm_group_check_async_error(c->g);
        EXPECT(st == SYMM_ERROR_TIMEOUT);
        char needle[32];
        snprintf(needle, sizeof needle, "rank %d", c->world - 1);
        EXPECT(strstr(symm_last_error(), needle) != NULL);
        if (c->rank == 0) printf("ok skipped_barrier_times_out: %s\n", symm_last_error());
    }
    // Wait out the others' timeout before unmapping (keeps their pads mapped).
    CHECK(symm_group_set_timeout(c->g, 30000));
    usleep(1500 * 1000);
    phase();
    CHECK(symm_handle_destroy(h));
    CHECK(symm_buffer_destroy(b));
}

static int run_rank(ctx_t *c) {
    g_rank = c->rank;
    CUDA_CHECK(cudaSetDevice(c->device));
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int backend;
    CHECK(symm_group_backend(c->g, &backend));
    EXPECT(backend == SYMM_BACKEND_CUDA);
    phase();
    data_through_peers(c, s);
    phase();
    ring_signals_and_flags(c, s);
    phase();
    graph_replayed_barrier(c, s);
    phase();
    if (g_bench) peer_copy_bandwidth(c, s);
    phase();
    no_leak(c);
    phase();
    skipped_barrier_times_out(c, s);
    phase();
    CUDA_CHECK(cudaStreamDestroy(s));
    return 0;
}

static int g_shared = 0;

static int rank_main(symm_group_t g, int rank, int world) {
    int device;
    CHECK(symm_group_device(g, &device));
    ctx_t c = {g, rank, world, device};
    return run_rank(&c);
}

static void *local_thread(void *p) {
    ctx_t *c = (ctx_t *)p;
    run_rank(c);
    return NULL;
}

int main(int argc, char **argv) {
    int world = 2, local = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--world-size") && i + 1 < argc) world = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shared-device")) g_shared = 1;
        else if (!strcmp(argv[i], "--local")) local = 1;
        else if (!strcmp(argv[i], "--bench")) g_bench = 1;
    }
    int ngpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&ngpus));
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_CUDA;
    cfg.timeout_ms = 30000;
    if (g_shared) cfg.flags = SYMM_GROUP_ALLOW_SHARED_DEVICE;
    if (local) {
        g_local = 1;
        pthread_barrier_init(&g_phase, NULL, world);
        std::vector<symm_group_t> groups(world);
        std::vector<int> devices(world);
        for (int r = 0; r < world; r++) devices[r] = g_shared ? 0 : r % ngpus;
        CHECK(symm_group_init_local(groups.data(), world, devices.data(), &cfg));
        std::vector<pthread_t> threads(world);
        std::vector<ctx_t> ctxs(world);
        for (int r = 0; r < world; r++) {
            ctxs[r] = {groups[r], r, world, devices[r]};
            pthread_create(&threads[r], NULL, local_thread, &ctxs[r]);
        }
        for (int r = 0; r < world; r++) pthread_join(threads[r], NULL);
        for (int r = 0; r < world; r++) CHECK(symm_group_destroy(groups[r]));
        printf("PASS cuda_memory --local world=%d shared=%d\n", world, g_shared);
        return 0;
    }
    if (!getenv("RANK")) {
        symm_unique_id_t id;
        char hex[2 * sizeof id + 1];
        CHECK(symm_get_unique_id(&id));
        launch_hex_encode(&id, sizeof id, hex);
        setenv("SYMM_UNIQUE_ID", hex, 1);
        int rc = launch_ranks(argv, world, -1, 300);
        printf("%s cuda_memory world=%d shared=%d\n", rc ? "FAIL" : "PASS", world, g_shared);
        return rc;
    }
    int rank = atoi(getenv("RANK"));
    symm_unique_id_t id;
    launch_hex_decode(getenv("SYMM_UNIQUE_ID"), &id, sizeof id);
    symm_group_t g;
    int device = g_shared ? 0 : rank % ngpus;
    CHECK(symm_group_init(&g, world, rank, device, &id, &cfg));
    int rc = rank_main(g, rank, world);
    CHECK(symm_group_destroy(g));
    return rc;
}
