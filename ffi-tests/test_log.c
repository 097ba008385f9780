/*
 * Logging through the C API: a callback installed with symm_set_log_callback
 * receives symm's lines at the level symm_set_log_level sets, and NULL
 * restores the default sink. Also the build information.
 */
#include "harness.h"

#define MAX_LINES 64

typedef struct {
    pthread_mutex_t lock;
    int count;
    int levels[MAX_LINES];
    char lines[MAX_LINES][512];
} seen_t;

static void collect(void *ctx, int level, const char *message) {
    seen_t *seen = (seen_t *)ctx;
    pthread_mutex_lock(&seen->lock);
    if (seen->count < MAX_LINES) {
        seen->levels[seen->count] = level;
        snprintf(seen->lines[seen->count], sizeof seen->lines[0], "%s", message);
        seen->count++;
    }
    pthread_mutex_unlock(&seen->lock);
}

/* How many lines at `level` contain both needles. */
static int count_lines(seen_t *seen, int level, const char *a, const char *b) {
    int n = 0;
    for (int i = 0; i < seen->count; i++) {
        if (seen->levels[i] == level && strstr(seen->lines[i], a) && strstr(seen->lines[i], b)) n++;
        EXPECT(!strchr(seen->lines[i], '\n'));
    }
    return n;
}

static void callback_sees_group_formation(void) {
    static seen_t seen = {PTHREAD_MUTEX_INITIALIZER, 0, {0}, {{0}}};
    CHECK(symm_set_log_callback(collect, &seen));
    CHECK(symm_set_log_level(SYMM_LOG_INFO));
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    symm_group_t g[2];
    CHECK(symm_group_init_local(g, 2, NULL, &cfg));
    /* Quiet again: nothing more reaches the callback. */
    CHECK(symm_set_log_level(SYMM_LOG_OFF));
    CHECK(symm_set_log_callback(NULL, NULL));
    pthread_mutex_lock(&seen.lock);
    EXPECT(count_lines(&seen, SYMM_LOG_INFO, ":r0/2 ", "group formed: host backend, world 2") == 1);
    EXPECT(count_lines(&seen, SYMM_LOG_INFO, ":r1/2 ", "group formed: host backend, world 2") == 1);
    EXPECT(!strncmp(seen.lines[0], "symm[", 5));
    int before = seen.count;
    pthread_mutex_unlock(&seen.lock);
    CHECK(symm_group_destroy(g[0]));
    CHECK(symm_group_destroy(g[1]));
    EXPECT(seen.count == before);
    EXPECT_STATUS(symm_set_log_level(9), SYMM_ERROR_INVALID_ARGUMENT);
}

static void build_info(void) {
    symm_build_info_t info;
    memset(&info, 0, sizeof info);
    EXPECT_STATUS(symm_get_build_info(&info), SYMM_ERROR_INVALID_ARGUMENT);
    EXPECT_MESSAGE("struct_size");
    info.struct_size = sizeof info;
    CHECK(symm_get_build_info(&info));
    EXPECT(info.struct_size == sizeof info);
    EXPECT(info.version_code == SYMM_VERSION_CODE);
    EXPECT(!strcmp(info.kernels, "fatbin") || !strcmp(info.kernels, "nvrtc"));
    EXPECT(info.version && info.kernels_build && strlen(info.kernels_build) > 0);
    printf("symm %s, kernels: %s (%s)\n", info.version, info.kernels, info.kernels_build);
}

int main(void) {
    callback_sees_group_formation();
    build_info();
    printf("test_log: ok\n");
    return 0;
}
