/*
 * The C API's contract on one process: version, status strings, NULL
 * arguments, destroyed and foreign handles, option structs, out-parameters
 * untouched on failure.
 */
#include "harness.h"

static void version_and_strings(void) {
    int v = -1;
    CHECK(symm_get_version(&v));
    EXPECT(v == SYMM_VERSION_CODE);
    EXPECT_STATUS(symm_get_version(NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("version is NULL");
    EXPECT(!strcmp(symm_status_string(SYMM_ERROR_TIMEOUT), "SYMM_ERROR_TIMEOUT"));
    EXPECT(!strcmp(symm_status_string(SYMM_SUCCESS), "SYMM_SUCCESS"));
    EXPECT(!strcmp(symm_status_string(12345), "SYMM_ERROR_UNKNOWN_STATUS"));
}

static void null_and_destroyed_handles(symm_group_t g) {
    int x = 7;
    EXPECT_STATUS(symm_group_rank(NULL, &x), SYMM_ERROR_INVALID_HANDLE);
    EXPECT_MESSAGE("NULL");
    EXPECT(x == 7);
    EXPECT_STATUS(symm_group_rank(g, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    /* A pointer symm never returned, and a handle of another type. */
    EXPECT_STATUS(symm_group_rank((symm_group_t)&x, &x), SYMM_ERROR_INVALID_HANDLE);
    EXPECT_MESSAGE("not a live symm_group_t");
    symm_buffer_t b;
    CHECK(symm_create(g, 100, &b));
    EXPECT_STATUS(symm_group_rank((symm_group_t)b, &x), SYMM_ERROR_INVALID_HANDLE);
    CHECK(symm_buffer_destroy(b));
    void *p = &x;
    EXPECT_STATUS(symm_buffer_ptr(b, &p), SYMM_ERROR_INVALID_HANDLE);
    EXPECT(p == &x);
    EXPECT_STATUS(symm_buffer_destroy(b), SYMM_ERROR_INVALID_HANDLE);
    /* Destroy accepts NULL. */
    CHECK(symm_group_destroy(NULL));
    CHECK(symm_buffer_destroy(NULL));
    CHECK(symm_handle_destroy(NULL));
    EXPECT_STATUS(symm_rendezvous(NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_STATUS(symm_barrier(NULL, 0, NULL), SYMM_ERROR_INVALID_HANDLE);
}

static void bad_arguments(symm_group_t g) {
    symm_buffer_t b = (symm_buffer_t)0x99;
    EXPECT_STATUS(symm_create(g, 0, &b), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT(b == (symm_buffer_t)0x99);
    EXPECT_STATUS(symm_create(g, 64, NULL), SYMM_ERROR_INVALID_ARGUMENT);

    symm_group_t g2 = NULL;
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.struct_size = 3;
    EXPECT_STATUS(symm_group_init_local(&g2, 1, NULL, &cfg), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("struct_size");
    cfg = (symm_group_config_t)SYMM_GROUP_CONFIG_INIT;
    cfg.backend = 42;
    EXPECT_STATUS(symm_group_init_local(&g2, 1, NULL, &cfg), SYMM_ERROR_INVALID_ARGUMENT);
    cfg = (symm_group_config_t)SYMM_GROUP_CONFIG_INIT;
    cfg.timeout_ms = -5;
    EXPECT_STATUS(symm_group_init_local(&g2, 1, NULL, &cfg), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT(g2 == NULL);
    EXPECT_STATUS(symm_group_init_local(&g2, 0, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    /* Past the largest group: refused before any rank's thread starts. */
    EXPECT_STATUS(symm_group_init_local(&g2, 257, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("n is 257; expected 1 to 256");
    EXPECT_STATUS(symm_group_init_local(&g2, 100000, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT(g2 == NULL);

    symm_unique_id_t id;
    memset(&id, 0xab, sizeof id);
    EXPECT_STATUS(symm_group_init(&g2, 2, 0, 0, &id, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    CHECK(symm_get_unique_id(&id));
    EXPECT_STATUS(symm_group_init(&g2, 2, 2, 0, &id, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_STATUS(symm_group_init(&g2, 0, 0, 0, &id, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_STATUS(symm_group_init(&g2, 2, 0, 0, NULL, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_STATUS(symm_get_unique_id_at("not an address", &id), SYMM_ERROR_INVALID_ARGUMENT);

    symm_bootstrap_t bs = SYMM_BOOTSTRAP_INIT;
    EXPECT_STATUS(symm_group_init_bootstrap(&g2, 1, 0, 0, &bs, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("allgather is NULL");
    EXPECT(g2 == NULL);

    /* Until the CUDA backend is built in, asking for it is a clear refusal. */
    cfg = (symm_group_config_t)SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_CUDA;
    symm_status_t st = symm_group_init_local(&g2, 1, NULL, &cfg);
    EXPECT(st == SYMM_ERROR_UNSUPPORTED || st == SYMM_ERROR_NO_DEVICE || st == SYMM_SUCCESS);
    if (st == SYMM_SUCCESS) CHECK(symm_group_destroy(g2));
}

static void handle_outlives_group(void) {
    /* Destroying the group first leaves buffers and handles usable. */
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    symm_group_t g;
    CHECK(symm_group_init_local(&g, 1, NULL, &cfg));
    symm_buffer_t b;
    symm_handle_t h;
    CHECK(symm_create(g, 1 << 20, &b));
    CHECK(symm_rendezvous(b, &h));
    CHECK(symm_group_destroy(g));
    CHECK(symm_buffer_destroy(b));
    char *p;
    CHECK(symm_handle_peer_ptr(h, 0, (void **)&p));
    p[(1 << 20) - 1] = 1;
    CHECK(symm_barrier(h, 0, NULL)); /* world of one: returns at once */
    EXPECT_STATUS(symm_barrier(h, 16, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    CHECK(symm_handle_destroy(h));
}

/* A group that checks operation arguments on every call, with one op. */
static void check_args_always_flag(void) {
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    cfg.flags = SYMM_GROUP_CHECK_ARGS_ALWAYS;
    symm_group_t g;
    CHECK(symm_group_init_local(&g, 1, NULL, &cfg));
    float in[4] = {1, 2, 3, 4}, out[4] = {0};
    int64_t shape[1] = {4};
    symm_tensor_t it = symm_tensor_contiguous(in, SYMM_DTYPE_F32, 1, shape);
    symm_tensor_t ot = symm_tensor_contiguous(out, SYMM_DTYPE_F32, 1, shape);
    CHECK(symm_lc_allgather(g, &it, &ot, NULL));
    EXPECT(out[3] == 4);
    CHECK(symm_group_destroy(g));
    cfg.flags = 4;
    EXPECT_STATUS(symm_group_init_local(&g, 1, NULL, &cfg), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("unknown bits 0x4");
}

static void plan_queries(void) {
    /* Two in-process ranks: a large all-gather + matmul overlaps its pulls. */
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    symm_group_t g[2];
    CHECK(symm_group_init_local(g, 2, NULL, &cfg));
    symm_plan_t p = SYMM_PLAN_INIT;
    CHECK(symm_plan_ag_mm(g[0], 16384, 8192, 8192, SYMM_DTYPE_BF16, &p));
    EXPECT(p.algorithm == SYMM_ALGORITHM_PIPELINED);
    EXPECT(p.compute_ms > 2.0 && p.exposed_ms < p.comm_ms && p.total_ms < p.compute_ms + p.comm_ms);
    CHECK(symm_plan_mm_rs(g[1], 512, 14336, 8192, SYMM_DTYPE_F16, &p));
    EXPECT(p.total_ms > 0);
    symm_plan_t untouched = SYMM_PLAN_INIT;
    EXPECT_STATUS(symm_plan_ag_mm(g[0], -1, 8, 8, SYMM_DTYPE_BF16, &untouched), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT(untouched.total_ms == 0);
    EXPECT_STATUS(symm_plan_ag_mm(g[0], 8, 8, 8, 99, &untouched), SYMM_ERROR_INVALID_ARGUMENT);
    untouched.struct_size = 8;
    EXPECT_STATUS(symm_plan_ag_mm(g[0], 8, 8, 8, SYMM_DTYPE_BF16, &untouched), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("SYMM_PLAN_INIT");
    CHECK(symm_group_destroy(g[0]));
    CHECK(symm_group_destroy(g[1]));
}

/* Which arguments each operation uses in place from symmetric memory. */
static void symmetric_args(void) {
    symm_symmetric_args_t a = SYMM_SYMMETRIC_ARGS_INIT;
    CHECK(symm_op_symmetric_args("all_reduce", &a));
    EXPECT(a.count == 1 && !strcmp(a.names[0], "input") && a.access[0] == SYMM_PEERS_READ);
    CHECK(symm_op_symmetric_args("lc_allgather", &a));
    EXPECT(a.count == 1 && !strcmp(a.names[0], "input") && a.access[0] == SYMM_PEERS_READ);
    CHECK(symm_op_symmetric_args("mm_rs", &a));
    EXPECT(a.count == 1 && !strcmp(a.names[0], "out") && a.access[0] == SYMM_PEERS_WRITE);
    CHECK(symm_op_symmetric_args("fused_ag_mm", &a));
    EXPECT(a.count == 1 && !strcmp(a.names[0], "a_shard") && a.access[0] == SYMM_PEERS_READ && a.names[1] == NULL);
    a.count = 7;
    EXPECT_STATUS(symm_op_symmetric_args("symm_mm_rs", &a), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("all_reduce_rmsnorm");
    EXPECT(a.count == 7);
    EXPECT_STATUS(symm_op_symmetric_args(NULL, &a), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_STATUS(symm_op_symmetric_args("mm_rs", NULL), SYMM_ERROR_INVALID_ARGUMENT);
    a.struct_size = sizeof(size_t);
    EXPECT_STATUS(symm_op_symmetric_args("mm_rs", &a), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("struct_size");
}

/* A struct_size past 65536 (an uninitialized struct) is refused before
 * symm reads or writes anything past the struct. */
static void huge_struct_sizes(void) {
    const size_t huge = (size_t)1 << 40;
    symm_symmetric_args_t a = SYMM_SYMMETRIC_ARGS_INIT;
    symm_build_info_t info;
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    symm_all_reduce_options_t opts = SYMM_ALL_REDUCE_OPTIONS_INIT;
    symm_group_t g = NULL;
    float in[4] = {1, 2, 3, 4}, out[4] = {0};
    int64_t shape[1] = {4};
    symm_tensor_t it = symm_tensor_contiguous(in, SYMM_DTYPE_F32, 1, shape);
    symm_tensor_t ot = symm_tensor_contiguous(out, SYMM_DTYPE_F32, 1, shape);
    a.struct_size = huge;
    a.count = 7;
    EXPECT_STATUS(symm_op_symmetric_args("mm_rs", &a), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("args->struct_size is 1099511627776; expected at most 65536");
    EXPECT(a.count == 7);
    memset(&info, 0, sizeof info);
    info.struct_size = huge;
    EXPECT_STATUS(symm_get_build_info(&info), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT(info.version == NULL);
    cfg.backend = SYMM_BACKEND_HOST;
    cfg.struct_size = huge;
    EXPECT_STATUS(symm_group_init_local(&g, 1, NULL, &cfg), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("config->struct_size");
    cfg.struct_size = sizeof cfg;
    CHECK(symm_group_init_local(&g, 1, NULL, &cfg));
    opts.struct_size = huge;
    EXPECT_STATUS(symm_all_reduce(g, &it, &ot, SYMM_REDUCE_SUM, &opts, NULL), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("opts->struct_size");
    EXPECT(out[0] == 0);
    opts.struct_size = sizeof opts;
    CHECK(symm_all_reduce(g, &it, &ot, SYMM_REDUCE_SUM, &opts, NULL));
    EXPECT(out[3] == 4);
    CHECK(symm_group_destroy(g));
}

/* rank 1's bytes as a caller's allgather gone wrong would give them:
 * all ones, all zeros, or rank 0's with a 1 TiB length in front. */
static int garbling;
static int garbled_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
    unsigned char *peer = (unsigned char *)recv + bytes;
    uint64_t huge = (uint64_t)1 << 40;
    (void)ctx;
    memcpy(recv, send, bytes);
    memcpy(peer, send, bytes);
    if (garbling == 0) memset(peer, 0xff, bytes);
    if (garbling == 1) memset(peer, 0, bytes);
    if (garbling == 2) memcpy(peer, &huge, sizeof huge);
    return 0;
}

/* Corrupt data from a caller's bootstrap: a clear SYMM_ERROR_BOOTSTRAP, not
 * a crash, an abort on a huge allocation, or SYMM_ERROR_INTERNAL. */
static void corrupt_bootstrap(void) {
    symm_bootstrap_t bs = SYMM_BOOTSTRAP_INIT;
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    bs.allgather = garbled_allgather;
    cfg.backend = SYMM_BACKEND_HOST;
    for (garbling = 0; garbling < 3; garbling++) {
        symm_group_t g = NULL;
        EXPECT_STATUS(symm_group_init_bootstrap(&g, 2, 0, 0, &bs, &cfg), SYMM_ERROR_BOOTSTRAP);
        EXPECT_MESSAGE("rank 1's data are corrupt");
        EXPECT(g == NULL);
    }
}

int main(void) {
    version_and_strings();
    check_args_always_flag();
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    symm_group_t g;
    CHECK(symm_group_init_local(&g, 1, NULL, &cfg));
    null_and_destroyed_handles(g);
    bad_arguments(g);
    CHECK(symm_group_destroy(g));
    handle_outlives_group();
    plan_queries();
    symmetric_args();
    corrupt_bootstrap();
    huge_struct_sizes();
    printf("test_api: ok\n");
    return 0;
}
