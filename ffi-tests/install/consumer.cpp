// A C++ program built against an installed symm through its CMake package
// (CMakeLists.txt here: find_package(symm), target symm::symm). Two ranks
// as two threads of this process on the host backend: each writes its rank
// into the next rank's symmetric buffer, then both meet at a barrier and
// check what they received. Run by ffi-tests/install/run.sh (CI: .ci/run).
#include <symm.h>

#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

namespace {

bool ok(symm_status_t st, const char *what) {
    if (st != SYMM_SUCCESS) {
        std::fprintf(stderr, "%s: %s: %s\n", what, symm_status_string(st), symm_last_error());
    }
    return st == SYMM_SUCCESS;
}

constexpr int kWorld = 2;
constexpr size_t kCount = 1024;

bool rank_main(symm_group_t group, int rank) {
    symm_buffer_t buf = nullptr;
    symm_handle_t handle = nullptr;
    void *next = nullptr, *mine = nullptr;
    bool good = ok(symm_create(group, kCount * sizeof(int32_t), &buf), "symm_create") &&
                ok(symm_rendezvous(buf, &handle), "symm_rendezvous") &&
                ok(symm_handle_peer_ptr(handle, (rank + 1) % kWorld, &next), "symm_handle_peer_ptr") &&
                ok(symm_handle_peer_ptr(handle, rank, &mine), "symm_handle_peer_ptr");
    if (good) {
        auto *out = static_cast<int32_t *>(next);
        for (size_t i = 0; i < kCount; i++) out[i] = rank + 1;
        good = ok(symm_barrier(handle, 0, nullptr), "symm_barrier");
    }
    if (good) {
        const int32_t want = (rank + kWorld - 1) % kWorld + 1;
        const auto *in = static_cast<const int32_t *>(mine);
        for (size_t i = 0; i < kCount && good; i++) {
            if (in[i] != want) {
                std::fprintf(stderr, "rank %d: element %zu is %d, expected %d\n", rank, i, in[i], want);
                good = false;
            }
        }
        // Nobody may free its buffer while a peer still writes into it.
        good = ok(symm_barrier(handle, 0, nullptr), "symm_barrier") && good;
    }
    good = ok(symm_handle_destroy(handle), "symm_handle_destroy") && good;
    good = ok(symm_buffer_destroy(buf), "symm_buffer_destroy") && good;
    return good;
}

}  // namespace

int main() {
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    cfg.backend = SYMM_BACKEND_HOST;
    cfg.timeout_ms = 60000;
    symm_group_t groups[kWorld];
    if (!ok(symm_group_init_local(groups, kWorld, nullptr, &cfg), "symm_group_init_local")) return 1;
    std::vector<char> good(kWorld, 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; r++) {
        threads.emplace_back([&, r] { good[r] = rank_main(groups[r], r); });
    }
    for (auto &t : threads) t.join();
    bool all = true;
    for (int r = 0; r < kWorld; r++) {
        all = ok(symm_group_destroy(groups[r]), "symm_group_destroy") && all && good[r];
    }
    if (!all) return 1;
    std::printf("C++ consumer: %d ranks exchanged through symmetric memory ok\n", kWorld);
    return 0;
}
