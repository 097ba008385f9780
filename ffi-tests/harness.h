/*
 * A tiny multi-process test harness for the C API.
 *
 * A test program defines `int rank_main(symm_group_t g, int rank, int world)`
 * and calls `harness_main(argc, argv, rank_main)`. Run without RANK in the
 * environment, the program is the launcher: it forms the bootstrap the
 * `--mode` asks for, starts `--world-size` copies of itself (fork + exec, or
 * threads for `--mode local`), kills them all if they outlive `--deadline`
 * seconds, and exits non-zero if any rank failed. Each rank forms its group
 * and runs rank_main.
 *
 *   --world-size N   ranks (default 2)
 *   --mode M         uid | env | callback | local (default uid)
 *   --skip-rank R    rank R never joins the group (for timeout tests)
 *   --deadline S     watchdog in seconds (default 120)
 */
#ifndef SYMM_TEST_HARNESS_H
#define SYMM_TEST_HARNESS_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launch.h" /* examples-c/: CHECK, hex helpers, launch_ranks */

/* Expect a specific failure status. */
#define EXPECT_STATUS(call, want)                                                    \
    do {                                                                             \
        symm_status_t s_ = (call);                                                   \
        if (s_ != (want)) {                                                          \
            fprintf(stderr, "%s:%d: %s -> %s, expected %s (%s)\n", __FILE__, __LINE__, \
                    #call, symm_status_string(s_), symm_status_string(want),         \
                    symm_last_error());                                              \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

#define EXPECT(cond)                                                                 \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);      \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

/* The last error text must mention `needle`. */
#define EXPECT_MESSAGE(needle)                                                       \
    do {                                                                             \
        if (!strstr(symm_last_error(), (needle))) {                                  \
            fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, \
                    symm_last_error(), (needle));                                    \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

typedef int (*rank_main_fn)(symm_group_t g, int rank, int world);

typedef struct {
    int world;
    const char *mode;
    int skip_rank;
    int deadline_s;
} harness_args_t;

static inline harness_args_t harness_parse(int argc, char **argv) {
    harness_args_t a = {2, "uid", -1, 120};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--world-size")) a.world = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--mode")) a.mode = argv[i + 1];
        else if (!strcmp(argv[i], "--skip-rank")) a.skip_rank = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--deadline")) a.deadline_s = atoi(argv[i + 1]);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); exit(2); }
    }
    if (a.world < 1) { fprintf(stderr, "--world-size must be >= 1\n"); exit(2); }
    return a;
}

static inline int env_int(const char *name) {
    const char *v = getenv(name);
    if (!v) { fprintf(stderr, "%s is not set\n", name); exit(2); }
    return atoi(v);
}

/* ---- the callback bootstrap: an allgather over a shared file -------------
 * Stands in for a framework's own channel (MPI, a torch store). Rounds
 * alternate between two slots, so a rank can never overwrite data a slower
 * rank still reads. */
#define CB_MAX_RANKS 16
#define CB_MAX_BYTES 65536
typedef struct {
    _Atomic unsigned long arrived[2];
    unsigned char data[2][CB_MAX_RANKS][CB_MAX_BYTES];
} cb_shared_t;

typedef struct {
    cb_shared_t *sh;
    int rank, world;
    unsigned long round;
} cb_ctx_t;

static inline int cb_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
    cb_ctx_t *c = (cb_ctx_t *)ctx;
    int timeout_s = getenv("SYMM_TEST_CB_TIMEOUT") ? atoi(getenv("SYMM_TEST_CB_TIMEOUT")) : 20;
    if (bytes > CB_MAX_BYTES) return 1;
    int slot = (int)(c->round % 2);
    unsigned long target = (c->round / 2 + 1) * (unsigned long)c->world;
    memcpy(c->sh->data[slot][c->rank], send, bytes);
    atomic_fetch_add(&c->sh->arrived[slot], 1);
    time_t start = time(NULL);
    while (atomic_load(&c->sh->arrived[slot]) < target) {
        if (time(NULL) - start > timeout_s) return 2; /* our own timeout: never hang */
        usleep(50);
    }
    for (int r = 0; r < c->world; r++) memcpy((char *)recv + r * bytes, c->sh->data[slot][r], bytes);
    c->round++;
    return 0;
}

static inline cb_shared_t *cb_map(const char *path, int create) {
    int fd = open(path, O_RDWR | (create ? O_CREAT | O_TRUNC : 0), 0600);
    if (fd < 0) { perror("open"); exit(1); }
    if (create && ftruncate(fd, sizeof(cb_shared_t)) != 0) { perror("ftruncate"); exit(1); }
    void *p = mmap(NULL, sizeof(cb_shared_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) { perror("mmap"); exit(1); }
    return (cb_shared_t *)p;
}

/* With --skip-rank, forming the group must fail on every present rank with
 * a timeout that names the missing one (the callback bootstrap reports its
 * own failure, which symm passes on as a bootstrap error). */
static inline int expect_missing_rank(symm_status_t st, const char *mode, int missing) {
    char needle[32];
    snprintf(needle, sizeof needle, "rank %d", missing);
    if (!strcmp(mode, "callback")) {
        EXPECT_STATUS(st, SYMM_ERROR_BOOTSTRAP);
    } else {
        EXPECT_STATUS(st, SYMM_ERROR_TIMEOUT);
        EXPECT_MESSAGE(needle);
    }
    return 0;
}

static inline int harness_rank(rank_main_fn f, harness_args_t a) {
    const char *mode = a.mode;
    int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    if (a.skip_rank >= 0) cfg.timeout_ms = 1500;
    symm_group_t g = NULL;
    symm_status_t st = SYMM_ERROR_INTERNAL;
    if (!strcmp(mode, "uid")) {
        symm_unique_id_t id;
        const char *hex = getenv("SYMM_TEST_ID");
        if (launch_hex_decode(hex, &id, sizeof id) != 0) return 2;
        st = symm_group_init(&g, world, rank, 0, &id, &cfg);
    } else if (!strcmp(mode, "env")) {
        st = symm_group_init_env(&g, &cfg);
    } else if (!strcmp(mode, "callback")) {
        static cb_ctx_t ctx;
        ctx.sh = cb_map(getenv("SYMM_TEST_CB_FILE"), 0);
        ctx.rank = rank; ctx.world = world; ctx.round = 0;
        symm_bootstrap_t bs = SYMM_BOOTSTRAP_INIT;
        bs.ctx = &ctx;
        bs.allgather = cb_allgather;
        st = symm_group_init_bootstrap(&g, world, rank, 0, &bs, &cfg);
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    if (a.skip_rank >= 0) return expect_missing_rank(st, mode, a.skip_rank);
    CHECK(st);
    int rc = f(g, rank, world);
    CHECK(symm_group_destroy(g));
    return rc;
}

/* ---- --mode local: one process, a thread per rank ------------------------- */
typedef struct { rank_main_fn f; symm_group_t g; int rank, world, rc; } local_rank_t;

static inline void *local_thread(void *p) {
    local_rank_t *r = (local_rank_t *)p;
    r->rc = r->f(r->g, r->rank, r->world);
    return NULL;
}

static inline int harness_local(rank_main_fn f, int world) {
    symm_group_t groups[64];
    pthread_t threads[64];
    local_rank_t ranks[64];
    if (world > 64) return 2;
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    CHECK(symm_group_init_local(groups, world, NULL, &cfg));
    for (int r = 0; r < world; r++) {
        ranks[r] = (local_rank_t){f, groups[r], r, world, 1};
        pthread_create(&threads[r], NULL, local_thread, &ranks[r]);
    }
    int rc = 0;
    for (int r = 0; r < world; r++) {
        pthread_join(threads[r], NULL);
        if (ranks[r].rc) { fprintf(stderr, "rank %d failed\n", r); rc = 1; }
        CHECK(symm_group_destroy(groups[r]));
    }
    return rc;
}

/* ---- the launcher ---------------------------------------------------------- */
static inline int free_port(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    bind(s, (struct sockaddr *)&a, sizeof a);
    getsockname(s, (struct sockaddr *)&a, &len);
    close(s);
    return ntohs(a.sin_port);
}

static inline int harness_launch(char **argv, harness_args_t a) {
    char buf[512];
    if (!strcmp(a.mode, "uid")) {
        symm_unique_id_t id;
        CHECK(symm_get_unique_id(&id));
        launch_hex_encode(&id, sizeof id, buf);
        setenv("SYMM_TEST_ID", buf, 1);
    } else if (!strcmp(a.mode, "env")) {
        /* symm's store takes MASTER_PORT + 1 (torchrun's own store has MASTER_PORT). */
        snprintf(buf, sizeof buf, "%d", free_port() - 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", buf, 1);
    } else if (!strcmp(a.mode, "callback")) {
        snprintf(buf, sizeof buf, "/tmp/symm-cb-%d", (int)getpid());
        cb_shared_t *sh = cb_map(buf, 1);
        munmap(sh, sizeof *sh);
        setenv("SYMM_TEST_CB_FILE", buf, 1);
    }
    if (a.skip_rank >= 0) setenv("SYMM_TEST_CB_TIMEOUT", "2", 1);
    int failed = launch_ranks(argv, a.world, a.skip_rank, a.deadline_s);
    if (!strcmp(a.mode, "callback")) unlink(getenv("SYMM_TEST_CB_FILE"));
    return failed;
}

static inline int harness_main(int argc, char **argv, rank_main_fn f) {
    harness_args_t a = harness_parse(argc, argv);
    if (getenv("RANK")) return harness_rank(f, a);
    int rc = !strcmp(a.mode, "local") ? harness_local(f, a.world) : harness_launch(argv, a);
    printf("%s --world-size %d --mode %s: %s\n", argv[0], a.world, a.mode, rc ? "FAILED" : "ok");
    return rc;
}

#endif
