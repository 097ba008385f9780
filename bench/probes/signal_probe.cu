// How soon does a peer GPU know that a pushed tile has landed? The fused
// reduce-scatter at mm_rs 512 (docs/history/KERNELS.md v23-v28b) ends on its last
// narrow tiles: TMA stores into the peer, their completion, then a flag
// written with st.release.sys, whose MEMBAR.SYS took ~3 us in the traces.
// NCCL's LL protocols carry the flag inside the data instead (no fence; LL:
// 4 bytes of data + 4 of flag per 8-byte store; LL128: 120 + 8 per 128-byte
// line, which relies on a warp's 128-byte store arriving whole over NVLink,
// something PTX does not promise). This probe times, for C CTAs on GPU 0
// pushing ~64 KiB each into GPU 1, from the first CTA's start to the moment
// GPU 1's receiving CTAs have seen all of their tile's data:
//
//   flag only       no data, one st.release.sys per CTA (the baseline: the
//                   two GPUs' clocks' offset plus one crossing)
//   tma + release   4 bulk copies of 16 KiB, their completion, the flag
//   threads+release 128 threads' 16-byte stores, a barrier, the flag
//   LL              128 KiB of {4 bytes data, 4 bytes flag}, polled per word
//   LL128           69632 bytes of 128-byte lines (65280 of data), polled per line
//
// The receivers then check every data word (mismatches are counted and
// printed: any for LL128 would mean torn lines). GPU clocks differ by an
// unknown constant, so compare the modes, or subtract the flag-only row.
// Every wait is bounded (1 s), then counted as a timeout.
//   nvcc -O2 -arch=sm_90a signal_probe.cu -o signal_probe && ./signal_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"
#include "probe_sync.h"

constexpr int THREADS = 128;                     // a sending CTA (a warpgroup, as a narrow tile's)
constexpr int RECV_THREADS = 256;                // a receiving CTA (an own tile's two consumer warpgroups)
constexpr int IN_FLIGHT = 8;                     // a receiving thread's loads at once
constexpr int TILE = 65536;                      // bytes of data per CTA (tma, threads)
constexpr int LL128_LINES = 544;                 // 16 per warp-iteration set; 544 x 120 = 65280 data bytes
constexpr size_t SLOT = 131072;                  // bytes per CTA in the receiver's buffer (LL's doubled tile)
constexpr int RUNS = 9;
constexpr uint64_t TIMEOUT_NS = 1000000000ull;
enum Mode { FLAG_ONLY, TMA_RELEASE, THREADS_RELEASE, LL, LL128, MODES };
const char* const MODE_NAMES[MODES] = {"flag only", "tma+release", "threads+release", "LL", "LL128"};

// Data word i of CTA c in run `epoch`: bit 63 set, so that no data word or
// LL data half ever equals a flag (an epoch, < 2^31).
__device__ __forceinline__ uint64_t pattern(uint32_t epoch, int c, uint32_t i) {
    return (1ull << 63) | ((uint64_t)(epoch & 0x7fffff) << 40) | ((uint64_t)c << 24) | i;
}

// LL: the data half of 8-byte word i (bit 31 set, unlike a flag).
__device__ __forceinline__ uint32_t ll_data(uint32_t epoch, int c, uint32_t i) {
    return (uint32_t)pattern(epoch, c, i) | 0x80000000u;
}

// LL128: data word `half` (0, 1) of 16-byte chunk `chunk` of `line`; a
// line holds 15 data words, chunk 7's second word being the flag.
__device__ __forceinline__ uint64_t ll128_data(uint32_t epoch, int c, int line, int chunk, int half) {
    return pattern(epoch, c, line * 15 + 2 * chunk + half);
}

// Sender (GPU 0): waits until every receiver CTA runs, then pushes its tile
// into the peer's slot and signals as `mode` says.
__global__ void __launch_bounds__(THREADS) send(int mode, uint32_t epoch, unsigned char* peer, uint32_t* peer_flags,
                                                const uint32_t* ready, uint32_t expected, uint64_t* starts,
                                                uint32_t* timeouts) {
    extern __shared__ __align__(128) unsigned char tile[];
    const int c = blockIdx.x;
    if (mode == TMA_RELEASE) {
        for (int i = threadIdx.x; i < TILE / 8; i += THREADS) ((uint64_t*)tile)[i] = pattern(epoch, c, i);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    if (threadIdx.x == 0) {
        const uint64_t t0 = now_ns();
        while (ld_acquire_sys(ready) < expected) {
            if (now_ns() - t0 > TIMEOUT_NS) {
                atomicAdd(timeouts, 1u);
                break;
            }
        }
        starts[c] = now_ns();
    }
    __syncthreads();
    unsigned char* slot = peer + c * SLOT;
    if (mode == FLAG_ONLY) {
        if (threadIdx.x == 0) st_release_sys(peer_flags + c, epoch);
    } else if (mode == TMA_RELEASE) {
        if (threadIdx.x == 0) {
            for (int part = 0; part < 4; part++) {
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(slot + part * 16384),
                             "r"((uint32_t)__cvta_generic_to_shared(tile + part * 16384)), "r"(16384)
                             : "memory");
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            asm volatile("fence.proxy.async.global;" ::: "memory");
            st_release_sys(peer_flags + c, epoch);
        }
    } else if (mode == THREADS_RELEASE) {
        for (int i = threadIdx.x; i < TILE / 16; i += THREADS) {
            const uint64_t a = pattern(epoch, c, 2 * i), b = pattern(epoch, c, 2 * i + 1);
            asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(slot + 16 * i), "l"(a), "l"(b) : "memory");
        }
        __syncthreads();
        // Cumulative: covers the CTA's stores, ordered before it by the barrier.
        if (threadIdx.x == 0) st_release_sys(peer_flags + c, epoch);
    } else if (mode == LL) {
        for (int i = threadIdx.x; i < TILE / 4; i += THREADS) {
            asm volatile("st.relaxed.sys.global.v2.u32 [%0], {%1, %2};" ::"l"(slot + 8 * i), "r"(ll_data(epoch, c, i)),
                         "r"(epoch)
                         : "memory");
        }
    } else {  // LL128: each warp writes 4 lines per instruction, the flag in each line's last 8 bytes
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        for (int line0 = warp * 4; line0 < LL128_LINES; line0 += 4 * (THREADS / 32)) {
            const int line = line0 + lane / 8, chunk = lane % 8;
            const uint64_t a = ll128_data(epoch, c, line, chunk, 0);
            const uint64_t b = chunk == 7 ? (uint64_t)epoch : ll128_data(epoch, c, line, chunk, 1);
            asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(slot + 128 * line + 16 * chunk), "l"(a),
                         "l"(b)
                         : "memory");
        }
    }
}

// Receiver (GPU 1): announces itself, waits for its tile as `mode` says,
// stamps the time, then checks the data. LL and LL128 read every word as an
// own tile would read its partials: 256 threads, 8 loads in flight each,
// a batch reloaded until all of its flags are there.
__global__ void __launch_bounds__(RECV_THREADS) receive(int mode, uint32_t epoch, const unsigned char* mine,
                                                        const uint32_t* flags, uint32_t* peer_ready, uint64_t* seen,
                                                        uint32_t* bad, uint32_t* timeouts) {
    const int c = blockIdx.x;
    const unsigned char* slot = mine + c * SLOT;
    const uint64_t t0 = now_ns();
    bool late = false;
    uint32_t wrong = 0;  // data words not as the sender wrote them
    if (threadIdx.x == 0) atomicAdd_system(peer_ready, 1u);
    if (mode == FLAG_ONLY || mode == TMA_RELEASE || mode == THREADS_RELEASE) {
        if (threadIdx.x == 0) {
            while (ld_acquire_sys(flags + c) != epoch) {
                if (now_ns() - t0 > TIMEOUT_NS) {
                    late = true;
                    break;
                }
            }
        }
    } else if (mode == LL) {
        constexpr int WORDS = TILE / 4;  // 8-byte {data, flag} words
        for (int base = threadIdx.x; base < WORDS && !late; base += IN_FLIGHT * RECV_THREADS) {
            uint32_t d[IN_FLIGHT], f[IN_FLIGHT];
            bool ready;
            do {
#pragma unroll
                for (int j = 0; j < IN_FLIGHT; j++) {
                    asm volatile("ld.relaxed.sys.global.v2.u32 {%0, %1}, [%2];"
                                 : "=r"(d[j]), "=r"(f[j])
                                 : "l"(slot + 8 * (base + j * RECV_THREADS)));
                }
                ready = true;
#pragma unroll
                for (int j = 0; j < IN_FLIGHT; j++) ready &= f[j] == epoch;
                late = now_ns() - t0 > TIMEOUT_NS;
            } while (!ready && !late);
            // LL's data is the half loaded with its flag.
#pragma unroll
            for (int j = 0; j < IN_FLIGHT; j++) {
                wrong += !late && d[j] != ll_data(epoch, c, base + j * RECV_THREADS);
            }
        }
    } else {  // LL128: a warp's load covers 4 lines; each line's last lane holds its flag
        constexpr int GROUPS = LL128_LINES / 4, WARPS = RECV_THREADS / 32;
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, chunk = lane % 8;
        for (int g0 = warp; g0 < GROUPS && !late; g0 += IN_FLIGHT * WARPS) {
            uint64_t a[IN_FLIGHT], b[IN_FLIGHT];
            bool ready;
            do {
#pragma unroll
                for (int j = 0; j < IN_FLIGHT; j++) {
                    const int line = (g0 + j * WARPS) * 4 + lane / 8;
                    if (g0 + j * WARPS < GROUPS) {
                        asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
                                     : "=l"(a[j]), "=l"(b[j])
                                     : "l"(slot + 128 * line + 16 * chunk));
                    } else {
                        a[j] = 0, b[j] = epoch;
                    }
                }
                bool mine_ready = true;
#pragma unroll
                for (int j = 0; j < IN_FLIGHT; j++) mine_ready &= chunk != 7 || b[j] == epoch;
                // Warp-uniform, so that the warp votes and leaves together.
                late = __any_sync(0xffffffffu, now_ns() - t0 > TIMEOUT_NS);
                ready = __all_sync(0xffffffffu, mine_ready);
            } while (!ready && !late);
            // LL128's data is what the same loads returned: torn lines show here.
#pragma unroll
            for (int j = 0; j < IN_FLIGHT; j++) {
                const int line = (g0 + j * WARPS) * 4 + lane / 8;
                if (!late && g0 + j * WARPS < GROUPS) {
                    wrong += a[j] != ll128_data(epoch, c, line, chunk, 0);
                    wrong += chunk != 7 && b[j] != ll128_data(epoch, c, line, chunk, 1);
                }
            }
        }
    }
    if (late) atomicAdd(timeouts, 1u);
    __syncthreads();
    if (threadIdx.x == 0) seen[c] = now_ns();
    // Untimed: after a released flag, every data word as the sender wrote it.
    if (mode == TMA_RELEASE || mode == THREADS_RELEASE) {
        for (int i = threadIdx.x; i < TILE / 8; i += RECV_THREADS) {
            wrong += ((const uint64_t*)slot)[i] != pattern(epoch, c, i);
        }
    }
    if (wrong) atomicAdd(bad, wrong);
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    int devices = 0;
    CK(cudaGetDeviceCount(&devices));
    if (devices < 2) {
        printf("signal_probe: needs two GPUs with peer access\n");
        return 0;
    }
    constexpr int MAX_CTAS = 132;
    cudaStream_t stream[2];
    unsigned char* buffer = nullptr;  // GPU 1: the receivers' slots
    uint32_t *flags = nullptr, *ready = nullptr, *counters[2] = {};
    uint64_t *stamps[2] = {};
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaDeviceEnablePeerAccess(1 - d, 0));
        CK(cudaStreamCreateWithFlags(&stream[d], cudaStreamNonBlocking));
        CK(cudaMalloc(&stamps[d], MAX_CTAS * sizeof(uint64_t)));
        CK(cudaMalloc(&counters[d], 2 * sizeof(uint32_t)));  // [0] timeouts, [1] wrong words
        CK(cudaMemset(counters[d], 0, 2 * sizeof(uint32_t)));
    }
    CK(cudaSetDevice(0));
    CK(cudaMalloc(&ready, sizeof(uint32_t)));
    CK(cudaFuncSetAttribute(send, cudaFuncAttributeMaxDynamicSharedMemorySize, TILE));
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&buffer, MAX_CTAS * SLOT));
    CK(cudaMemset(buffer, 0, MAX_CTAS * SLOT));
    CK(cudaMalloc(&flags, MAX_CTAS * sizeof(uint32_t)));
    CK(cudaMemset(flags, 0, MAX_CTAS * sizeof(uint32_t)));

    const int counts[] = {8, 24, 68, 132};
    printf("signal: C CTAs on GPU 0 push ~64 KiB each into GPU 1; us from the first send to the last tile seen,\n"
           "median of %d (GPU 1's clock minus GPU 0's: compare rows, or subtract 'flag only')\n", RUNS);
    printf("%5s", "C");
    for (int m = 0; m < MODES; m++) printf(" %16s", MODE_NAMES[m]);
    printf("\n");
    uint32_t epoch = 0;
    std::vector<uint64_t> starts(MAX_CTAS), seen(MAX_CTAS);
    for (int ctas : counts) {
        printf("%5d", ctas);
        for (int mode = 0; mode < MODES; mode++) {
            std::vector<double> runs;
            for (int run = 0; run < RUNS; run++) {
                epoch++;
                // `ready` counts this run's receiver CTAs: zeroed before they
                // start; the senders wait until all of them run.
                CK(cudaSetDevice(0));
                CK(cudaMemsetAsync(ready, 0, sizeof(uint32_t), stream[0]));
                CK(cudaStreamSynchronize(stream[0]));
                CK(cudaSetDevice(1));
                receive<<<ctas, RECV_THREADS, 0, stream[1]>>>(mode, epoch, buffer, flags, ready, stamps[1], counters[1] + 1,
                                                         counters[1]);
                CK(cudaGetLastError());
                CK(cudaSetDevice(0));
                send<<<ctas, THREADS, TILE, stream[0]>>>(mode, epoch, buffer, flags, ready, ctas, stamps[0],
                                                         counters[0]);
                CK(cudaGetLastError());
                for (int d = 0; d < 2; d++) {
                    CK(cudaSetDevice(d));
                    CK(cudaStreamSynchronize(stream[d]));
                }
                CK(cudaMemcpy(starts.data(), stamps[0], ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                CK(cudaSetDevice(1));
                CK(cudaMemcpy(seen.data(), stamps[1], ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                const uint64_t first = *std::min_element(starts.begin(), starts.begin() + ctas);
                const uint64_t last = *std::max_element(seen.begin(), seen.begin() + ctas);
                runs.push_back(((double)(int64_t)(last - first)) / 1e3);
            }
            printf(" %16.2f", median(runs));
            fflush(stdout);
            uint32_t timeouts[2];
            for (int d = 0; d < 2; d++) {
                CK(cudaSetDevice(d));
                CK(cudaMemcpy(&timeouts[d], counters[d], sizeof(uint32_t), cudaMemcpyDeviceToHost));
            }
            if (timeouts[0] || timeouts[1]) {  // every later run would wait its second too
                printf("\ntimeouts in mode %s: senders %u, receivers %u; stopping\n", MODE_NAMES[mode], timeouts[0],
                       timeouts[1]);
                return 1;
            }
        }
        printf("\n");
    }
    uint32_t host[2][2];
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaMemcpy(host[d], counters[d], sizeof(host[d]), cudaMemcpyDeviceToHost));
    }
    printf("timeouts: senders %u, receivers %u; wrong data words seen by receivers: %u\n", host[0][0], host[1][0],
           host[1][1]);
    return host[0][0] || host[1][0] || host[1][1] ? 1 : 0;
}
