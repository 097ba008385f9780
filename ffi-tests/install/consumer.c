/* A C program built against an installed symm the way a user builds one:
 *
 *   cc consumer.c -o consumer $(pkg-config --cflags --libs symm)
 *
 * It checks that the library it loaded is the header's version, then forms
 * a one-rank group on the host backend and makes a symmetric buffer. Run by
 * ffi-tests/install/run.sh (CI: .ci/run). */
#include <stdio.h>
#include <string.h>

#include <symm.h>

#define CHECK(call)                                                              \
    do {                                                                         \
        symm_status_t st_ = (call);                                              \
        if (st_ != SYMM_SUCCESS) {                                               \
            fprintf(stderr, "%s: %s: %s\n", #call, symm_status_string(st_),      \
                    symm_last_error());                                          \
            return 1;                                                            \
        }                                                                        \
    } while (0)

int main(void) {
    int32_t version = 0;
    CHECK(symm_get_version(&version));
    if (version != SYMM_VERSION_CODE) {
        fprintf(stderr, "loaded libsymm is version %d, symm.h says %d\n", (int)version, SYMM_VERSION_CODE);
        return 1;
    }
    symm_build_info_t info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    CHECK(symm_get_build_info(&info));

    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    symm_group_t group;
    CHECK(symm_group_init_local(&group, 1, NULL, &cfg));
    int rank = -1, world = 0;
    CHECK(symm_group_rank(group, &rank));
    CHECK(symm_group_world_size(group, &world));
    symm_buffer_t buf;
    CHECK(symm_create(group, 4096, &buf));
    symm_handle_t handle;
    CHECK(symm_rendezvous(buf, &handle));
    void *mine = NULL;
    CHECK(symm_handle_peer_ptr(handle, 0, &mine));
    memset(mine, 1, 4096);
    CHECK(symm_handle_destroy(handle));
    CHECK(symm_buffer_destroy(buf));
    CHECK(symm_group_destroy(group));
    if (rank != 0 || world != 1) {
        fprintf(stderr, "rank %d of %d, expected 0 of 1\n", rank, world);
        return 1;
    }
    printf("C consumer: symm %s (kernels: %s), one-rank host group ok\n", info.version, info.kernels);
    return 0;
}
