/*
 * A small launcher for symm's C examples (header-only; copy it freely).
 *
 * `example_main(argc, argv, run)` makes a program its own launcher: started
 * plainly, it creates a bootstrap id, starts `--world-size N` copies of
 * itself (one process per rank, RANK / LOCAL_RANK set) and waits for them;
 * each copy forms the group and calls `run(group, rank, world)`.
 * With torchrun or your own launcher, set RANK and WORLD_SIZE (plus
 * SYMM_UNIQUE_ID, or MASTER_ADDR / MASTER_PORT for symm_group_init_env).
 */
#ifndef SYMM_EXAMPLES_LAUNCH_H
#define SYMM_EXAMPLES_LAUNCH_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "symm.h"

/* Exit with file, line, status and symm's message when a call fails. */
#define CHECK(call)                                                                  \
    do {                                                                             \
        symm_status_t s_ = (call);                                                   \
        if (s_ != SYMM_SUCCESS) {                                                    \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,      \
                    symm_status_string(s_), symm_last_error());                      \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

static inline void launch_hex_encode(const void *in, size_t n, char *out) {
    const unsigned char *b = (const unsigned char *)in;
    for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

static inline int launch_hex_decode(const char *in, void *out, size_t n) {
    unsigned char *b = (unsigned char *)out;
    if (!in || strlen(in) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(in + 2 * i, "%2x", &v) != 1) return -1;
        b[i] = (unsigned char)v;
    }
    return 0;
}

/* Starts `world` copies of this program (rank `skip_rank` exits at once, for
 * tests), kills them all if any outlives `deadline_s`, and returns 0 when
 * every rank exited 0. */
static inline int launch_ranks(char **argv, int world, int skip_rank, int deadline_s) {
    char buf[32];
    pid_t pids[256];
    if (world < 1 || world > 256) return 2;
    snprintf(buf, sizeof buf, "%d", world);
    setenv("WORLD_SIZE", buf, 1);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            if (r == skip_rank) _exit(0);
            snprintf(buf, sizeof buf, "%d", r);
            setenv("RANK", buf, 1);
            setenv("LOCAL_RANK", buf, 1);
            execv("/proc/self/exe", argv);
            _exit(127);
        }
    }
    int failed = 0, left = world;
    time_t start = time(NULL);
    while (left > 0) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            left--;
            for (int r = 0; r < world; r++)
                if (pids[r] == p && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
                    fprintf(stderr, "rank %d failed (wait status %d)\n", r, st);
                    failed = 1;
                }
        } else if (time(NULL) - start > deadline_s) {
            fprintf(stderr, "ranks still running after %d s: killing them\n", deadline_s);
            for (int r = 0; r < world; r++) kill(pids[r], SIGKILL);
            while (waitpid(-1, &st, 0) > 0) {}
            return 1;
        } else {
            usleep(1000);
        }
    }
    return failed;
}

typedef int (*example_fn)(symm_group_t group, int rank, int world);

static inline int example_main(int argc, char **argv, example_fn run) {
    int world = 2;
    for (int i = 1; i + 1 < argc; i += 2)
        if (!strcmp(argv[i], "--world-size")) world = atoi(argv[i + 1]);
    if (!getenv("RANK")) {
        symm_unique_id_t id;
        char hex[2 * sizeof id + 1];
        CHECK(symm_get_unique_id(&id));
        launch_hex_encode(&id, sizeof id, hex);
        setenv("SYMM_UNIQUE_ID", hex, 1);
        return launch_ranks(argv, world, -1, 600);
    }
    int rank = atoi(getenv("RANK"));
    world = getenv("WORLD_SIZE") ? atoi(getenv("WORLD_SIZE")) : world;
    int device = getenv("LOCAL_RANK") ? atoi(getenv("LOCAL_RANK")) : rank;
    symm_group_t group;
    symm_unique_id_t id;
    if (launch_hex_decode(getenv("SYMM_UNIQUE_ID"), &id, sizeof id) == 0) {
        CHECK(symm_group_init(&group, world, rank, device, &id, NULL));
    } else {
        CHECK(symm_group_init_env(&group, NULL));
    }
    int rc = run(group, rank, world);
    CHECK(symm_group_destroy(group));
    return rc;
}

#endif
