// How fast can two GPUs reduce-scatter a decode-sized message, one kernel
// per call, back to back as a CUDA graph replays them? symm's reduce-scatter
// kernels take 7 us at 128 KiB per chunk and 9 us at 512 KiB in lock step
// (bench/results/2026-11-30-h200-x2-7a28b0f-pipelined-profiles/), while one
// crossing of NVLink and a kernel launch take a few us. This probe times,
// per call of a graph of CALLS kernels on each GPU (both replayed at once;
// medians of REPS replays; the slower GPU), each rank summing its chunk of
// bf16 with the peer's chunk for it:
//
//   ping          one thread: a flag to the peer, a wait for the peer's
//   pieces+fence  symm_rs_two_shot's protocol: each block stores its 4 KiB
//                 pieces into the peer's scratch (16-byte stores), a
//                 system fence and a released flag per piece, then waits
//                 for the peer's flags of its own pieces and sums
//   pieces        the same without the fence (the release alone, after a
//                 block barrier, which PTX makes cumulative)
//   pieces 16K    the same with 16 KiB pieces (fewer blocks and flags)
//   LL            every 8 bytes sent as a 16-byte line {data, seq, data,
//                 seq}, polled by the receiver: no fence, no flag, twice
//                 the bytes
//
// The call count lives in device memory (read at the start, raised by the
// last block), so replays count as calls do; scratch alternates between
// two halves by the count's parity, as symm's does. The last call's output
// is checked against the exact sums.
//   nvcc -O2 -arch=sm_90a rs_latency_probe.cu -o rs_latency_probe && ./rs_latency_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_check.h"
#include "probe_sync.h"

constexpr int THREADS = 512;
constexpr int CALLS = 20;  // kernels per graph
constexpr int REPS = 20;   // graph replays timed
constexpr int MAX_BLOCKS = 128;
constexpr uint64_t TIMEOUT_NS = 1000000000ull;
enum Mode { PING, PIECES_FENCE, PIECES, PIECES_16K, LL, MODES };
const char* const NAMES[MODES] = {"ping", "pieces+fence", "pieces", "pieces 16K", "LL"};

struct Args {
    int rank;
    uint64_t bytes;              // per chunk
    const unsigned char* input;  // 2 chunks: [peer's, own] by rank order
    unsigned char* output;       // bytes
    unsigned char* peer_scratch; // the peer's scratch: 2 parities x bytes (LL: x 2)
    const unsigned char* scratch;
    uint32_t* peer_flags;        // the peer's flags: one per piece
    const uint32_t* flags;
    uint32_t* counter;           // [0] calls done, [1] blocks done
    uint32_t* timeouts;
};

// 8 bf16 of a and 8 of b, summed in f32, as 8 bf16 (round to nearest even).
__device__ __forceinline__ uint4 add_bf16x8(uint4 a, uint4 b) {
    const uint32_t* x = &a.x;
    const uint32_t* y = &b.x;
    uint4 r;
    uint32_t* z = &r.x;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float lo = __uint_as_float(x[j] << 16) + __uint_as_float(y[j] << 16);
        const float hi = __uint_as_float(x[j] & 0xffff0000u) + __uint_as_float(y[j] & 0xffff0000u);
        auto round = [](float f) {
            const uint32_t u = __float_as_uint(f);
            return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        };
        z[j] = round(lo) | (round(hi) << 16);
    }
    return r;
}

__device__ bool wait_flag(const uint32_t* flag, uint32_t seq, uint32_t* timeouts) {
    const uint64_t t0 = now_ns();
    while ((int32_t)(ld_acquire_sys(flag) - seq) < 0) {
        if (now_ns() - t0 > TIMEOUT_NS) {
            atomicAdd(timeouts, 1u);
            return false;
        }
    }
    return true;
}

template <int MODE>
__global__ void __launch_bounds__(THREADS) exchange(Args a) {
    __shared__ uint32_t s_seq;
    if (threadIdx.x == 0) s_seq = *(volatile uint32_t*)a.counter + 1u;
    __syncthreads();
    const uint32_t seq = s_seq;
    const uint64_t parity = seq & 1u;
    const unsigned char* theirs = a.input + (uint64_t)(1 - a.rank) * a.bytes;  // the peer's chunk of mine
    const unsigned char* own = a.input + (uint64_t)a.rank * a.bytes;
    if (MODE == PING) {
        if (threadIdx.x == 0) {
            st_release_sys(a.peer_flags, seq);
            wait_flag(a.flags, seq, a.timeouts);
        }
    } else if (MODE == LL) {
        // Line i carries bytes 8i..8i+8 of the peer's chunk.
        const uint64_t lines = a.bytes / 8, base = parity * a.bytes * 2;
        const uint64_t stride = (uint64_t)gridDim.x * THREADS;
        for (uint64_t i = blockIdx.x * THREADS + threadIdx.x; i < lines; i += stride) {
            const uint2 v = *(const uint2*)(theirs + 8 * i);
            asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(a.peer_scratch + base + 16 * i),
                         "r"(v.x), "r"(seq), "r"(v.y), "r"(seq)
                         : "memory");
        }
        // Two lines (16 bytes of data) per step, summed with the own chunk.
        for (uint64_t i = blockIdx.x * THREADS + threadIdx.x; i < lines / 2; i += stride) {
            uint4 l0, l1;
            const uint64_t t0 = now_ns();
            do {
                asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(l0.x), "=r"(l0.y), "=r"(l0.z), "=r"(l0.w)
                             : "l"(a.scratch + base + 32 * i));
                asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(l1.x), "=r"(l1.y), "=r"(l1.z), "=r"(l1.w)
                             : "l"(a.scratch + base + 32 * i + 16));
                if (now_ns() - t0 > TIMEOUT_NS) {
                    atomicAdd(a.timeouts, 1u);
                    break;
                }
            } while (l0.y != seq || l0.w != seq || l1.y != seq || l1.w != seq);
            const uint4 got = make_uint4(l0.x, l0.z, l1.x, l1.z);
            *(uint4*)(a.output + 16 * i) = add_bf16x8(*(const uint4*)(own + 16 * i), got);
        }
    } else {
        const uint64_t piece = MODE == PIECES_16K ? 16384 : 4096;
        const uint64_t pieces = (a.bytes + piece - 1) / piece, base = parity * a.bytes;
        for (uint64_t p = blockIdx.x; p < pieces; p += gridDim.x) {
            const uint64_t end = min(a.bytes, (p + 1) * piece);
            for (uint64_t o = p * piece + 16 * threadIdx.x; o < end; o += 16 * THREADS) {
                *(uint4*)(a.peer_scratch + base + o) = *(const uint4*)(theirs + o);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            if (MODE == PIECES_FENCE) __threadfence_system();
            for (uint64_t p = blockIdx.x; p < pieces; p += gridDim.x) st_release_sys(a.peer_flags + p, seq);
        }
        for (uint64_t p = blockIdx.x; p < pieces; p += gridDim.x) {
            if (threadIdx.x == 0) wait_flag(a.flags + p, seq, a.timeouts);
            __syncthreads();
            const uint64_t end = min(a.bytes, (p + 1) * piece);
            for (uint64_t o = p * piece + 16 * threadIdx.x; o < end; o += 16 * THREADS) {
                uint4 got;
                asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(got.x), "=r"(got.y), "=r"(got.z), "=r"(got.w)
                             : "l"(a.scratch + base + o));
                *(uint4*)(a.output + o) = add_bf16x8(*(const uint4*)(own + o), got);
            }
        }
    }
    // The last block to finish counts the call.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(a.counter + 1, 1u) == gridDim.x - 1) {
            a.counter[1] = 0;
            __threadfence();
            *(volatile uint32_t*)a.counter = seq;
        }
    }
}

static int grid_of(int mode, uint64_t bytes) {
    if (mode == PING) return 1;
    if (mode == LL) return (int)std::min<uint64_t>(MAX_BLOCKS, std::max<uint64_t>(1, bytes / 8 / THREADS));
    const uint64_t piece = mode == PIECES_16K ? 16384 : 4096;
    return (int)std::min<uint64_t>(MAX_BLOCKS, (bytes + piece - 1) / piece);
}

static void launch(int mode, int grid, const Args& a, cudaStream_t s) {
    switch (mode) {
        case PING: exchange<PING><<<grid, THREADS, 0, s>>>(a); break;
        case PIECES_FENCE: exchange<PIECES_FENCE><<<grid, THREADS, 0, s>>>(a); break;
        case PIECES: exchange<PIECES><<<grid, THREADS, 0, s>>>(a); break;
        case PIECES_16K: exchange<PIECES_16K><<<grid, THREADS, 0, s>>>(a); break;
        default: exchange<LL><<<grid, THREADS, 0, s>>>(a); break;
    }
    CK(cudaGetLastError());
}

// bf16 of a float (truncated: exact for the small integers used here), and back.
static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
static float as_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main() {
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    if (n < 2) {
        printf("skipped: needs two GPUs (found %d)\n", n);
        return 0;
    }
    const uint64_t sizes[] = {32 << 10, 128 << 10, 512 << 10, 2 << 20};
    const uint64_t max_bytes = 2 << 20;
    unsigned char *input[2], *output[2], *scratch[2];
    std::vector<uint16_t> host_input[2];  // what each rank's input holds
    uint32_t *flags[2], *counter[2], *timeouts[2];
    cudaStream_t stream[2];
    for (int r = 0; r < 2; r++) {
        CK(cudaSetDevice(r));
        CK(cudaDeviceEnablePeerAccess(1 - r, 0));
        CK(cudaStreamCreateWithFlags(&stream[r], cudaStreamNonBlocking));
        CK(cudaMalloc(&input[r], 2 * max_bytes));
        CK(cudaMalloc(&output[r], max_bytes));
        CK(cudaMalloc(&scratch[r], 4 * max_bytes));  // LL: 2 parities x twice the bytes
        CK(cudaMalloc(&flags[r], 4096 * sizeof(uint32_t)));
        CK(cudaMalloc(&counter[r], 2 * sizeof(uint32_t)));
        CK(cudaMalloc(&timeouts[r], sizeof(uint32_t)));
        // Small integers, exact in bf16 and in their sums: (r + 1) * (e % 64) + half.
        std::vector<uint16_t>& h = host_input[r];
        h.resize(2 * max_bytes / 2);
        for (size_t i = 0; i < h.size(); i++) {
            const size_t c = i / (max_bytes / 2), e = i % (max_bytes / 2);
            h[i] = bf16((float)((r + 1) * (e % 64) + c));
        }
        CK(cudaMemcpy(input[r], h.data(), 2 * max_bytes, cudaMemcpyHostToDevice));
    }
    printf("rs_latency_probe: us per call in lock step (graphs of %d calls, median of %d replays, slower GPU)\n",
           CALLS, REPS);
    for (uint64_t bytes : sizes) {
        for (int mode = 0; mode < MODES; mode++) {
            const int grid = grid_of(mode, bytes);
            cudaGraphExec_t exec[2];
            for (int r = 0; r < 2; r++) {
                CK(cudaSetDevice(r));
                CK(cudaMemset(scratch[r], 0, 4 * max_bytes));
                CK(cudaMemset(flags[r], 0, 4096 * sizeof(uint32_t)));
                CK(cudaMemset(counter[r], 0, 2 * sizeof(uint32_t)));
                CK(cudaMemset(timeouts[r], 0, sizeof(uint32_t)));
                CK(cudaMemset(output[r], 0xff, max_bytes));
                CK(cudaDeviceSynchronize());
            }
            for (int r = 0; r < 2; r++) {
                CK(cudaSetDevice(r));
                const Args a{r, bytes, input[r], output[r], scratch[1 - r], scratch[r], flags[1 - r], flags[r],
                             counter[r], timeouts[r]};
                cudaGraph_t g;
                CK(cudaStreamBeginCapture(stream[r], cudaStreamCaptureModeThreadLocal));
                for (int i = 0; i < CALLS; i++) launch(mode, grid, a, stream[r]);
                CK(cudaStreamEndCapture(stream[r], &g));
                CK(cudaGraphInstantiate(&exec[r], g, 0));
                CK(cudaGraphDestroy(g));
            }
            std::vector<float> per_call;
            cudaEvent_t start[2], stop[2];
            for (int r = 0; r < 2; r++) {
                CK(cudaSetDevice(r));
                CK(cudaEventCreate(&start[r]));
                CK(cudaEventCreate(&stop[r]));
            }
            for (int rep = 0; rep < REPS + 2; rep++) {
                for (int r = 0; r < 2; r++) {
                    CK(cudaSetDevice(r));
                    CK(cudaEventRecord(start[r], stream[r]));
                    CK(cudaGraphLaunch(exec[r], stream[r]));
                    CK(cudaEventRecord(stop[r], stream[r]));
                }
                float worst = 0;
                for (int r = 0; r < 2; r++) {
                    CK(cudaSetDevice(r));
                    CK(cudaEventSynchronize(stop[r]));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, start[r], stop[r]));
                    worst = std::max(worst, ms);
                }
                if (rep >= 2) per_call.push_back(worst * 1000 / CALLS);
            }
            std::sort(per_call.begin(), per_call.end());
            // Rank r's output: rank 0's chunk r plus rank 1's (chunk c at input + c * bytes).
            uint32_t bad = 0, late = 0;
            if (mode != PING) {
                std::vector<uint16_t> out(bytes / 2);
                for (int r = 0; r < 2; r++) {
                    CK(cudaSetDevice(r));
                    CK(cudaMemcpy(out.data(), output[r], bytes, cudaMemcpyDeviceToHost));
                    for (uint64_t e = 0; e < bytes / 2; e++) {
                        const uint64_t at = (uint64_t)r * bytes / 2 + e;  // what the kernels read
                        bad += as_float(out[e]) != as_float(host_input[0][at]) + as_float(host_input[1][at]);
                    }
                }
            }
            for (int r = 0; r < 2; r++) {
                CK(cudaSetDevice(r));
                uint32_t t;
                CK(cudaMemcpy(&t, timeouts[r], sizeof t, cudaMemcpyDeviceToHost));
                late += t;
                CK(cudaGraphExecDestroy(exec[r]));
                CK(cudaEventDestroy(start[r]));
                CK(cudaEventDestroy(stop[r]));
            }
            printf("%8llu KiB  %-13s grid %3d  median %6.2f  min %6.2f  max %6.2f us   wrong %u  timeouts %u\n",
                   (unsigned long long)(bytes >> 10), NAMES[mode], grid, per_call[per_call.size() / 2], per_call[0],
                   per_call.back(), bad, late);
        }
    }
    return 0;
}
