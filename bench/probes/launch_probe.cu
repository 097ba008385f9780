// What does a launch of the fused matmul cost the host, and how long after
// the host starts issuing it does a call on an idle GPU end? The fused
// kernel takes ~2.1 KiB of __grid_constant__ arguments (five tensor maps in
// symm_rs_maps plus four more, and the 488-byte parameter block), 132 CTAs
// of 384 threads and ~225 KiB of dynamic shared memory; the bound mm_rs
// call at M = 512 measured ~9 us of host time against ~6 for a replayed
// graph of several small kernels (docs/history/NOTES.md).
// This probe launches empty kernels that differ in one of those at a time:
//
//   small:  one 8-byte pointer argument
//   big:    the fused kernel's argument layout (2152 bytes, 64-byte aligned maps)
//   graph:  `big` as the one node of a graph, by cuGraphLaunch
//
// each on a tiny grid (1 CTA of 32 threads) and on the fused kernel's grid.
// host_us: median over 30 batches of 20 back-to-back launches of the host
// time per cuLaunchKernel / cuGraphLaunch. idle_us: median of 200 single
// launches timed as bench_ops.py times a call (an event, the launch, an
// event, on an idle stream): host issue plus the GPU's start and end.
//   nvcc -O2 -arch=sm_90a launch_probe.cu -lcuda -o launch_probe && ./launch_probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"

struct alignas(64) Map {
    uint64_t w[16];
};
struct RsMaps {
    Map inbox;
    Map push[8];
};
struct Params {
    unsigned char bytes[488];
};

__global__ void k_small(const int* p) {
    if (p && threadIdx.x == 1024) printf("%d\n", *p);  // never: keeps the argument
}

__global__ void k_big(const __grid_constant__ Map a, const __grid_constant__ Map al, const __grid_constant__ Map b,
                      const __grid_constant__ Map c, const __grid_constant__ RsMaps rs,
                      const __grid_constant__ Params p) {
    if (threadIdx.x == 1024) printf("%d %d %d\n", (int)a.w[0], (int)rs.push[7].w[15], (int)p.bytes[487]);
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static double us_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
}

int main() {
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUfunction f_small, f_big;
    CK(cudaGetFuncBySymbol((cudaFunction_t*)&f_small, (const void*)k_small));
    CK(cudaGetFuncBySymbol((cudaFunction_t*)&f_big, (const void*)k_big));
    const int smem = 230496;
    CK(cudaFuncSetAttribute((const void*)k_small, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute((const void*)k_big, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

    Map a{}, al{}, b{}, c{};
    RsMaps rs{};
    Params p{};
    const int* null_ptr = nullptr;
    void* big_args[] = {&a, &al, &b, &c, &rs, &p};
    void* small_args[] = {&null_ptr};
    printf("argument bytes: small %zu, big %zu\n", sizeof(null_ptr),
           4 * sizeof(Map) + sizeof(RsMaps) + sizeof(Params));

    struct Grid {
        const char* name;
        unsigned ctas, threads;
        int smem;
    } grids[] = {{"1x32, no smem", 1, 32, 0}, {"132x384, 225 KiB smem", 132, 384, smem}};

    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (const Grid& g : grids) {
        // The graph of one `big` launch on this grid.
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        if (cuLaunchKernel(f_big, g.ctas, 1, 1, g.threads, 1, 1, g.smem, s, big_args, nullptr) != CUDA_SUCCESS) {
            fprintf(stderr, "capture launch failed\n");
            return 1;
        }
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        auto launch = [&](int which) {
            CUresult r = CUDA_SUCCESS;
            if (which == 0) r = cuLaunchKernel(f_small, g.ctas, 1, 1, g.threads, 1, 1, g.smem, s, small_args, nullptr);
            if (which == 1) r = cuLaunchKernel(f_big, g.ctas, 1, 1, g.threads, 1, 1, g.smem, s, big_args, nullptr);
            if (which == 2) r = cuGraphLaunch((CUgraphExec)exec, s);
            if (r != CUDA_SUCCESS) {
                fprintf(stderr, "launch %d failed: %d\n", which, (int)r);
                exit(1);
            }
        };
        const char* names[] = {"small", "big", "graph"};
        for (int which = 0; which < 3; which++) {
            for (int i = 0; i < 50; i++) launch(which);
            CK(cudaStreamSynchronize(s));
            std::vector<double> host, idle;
            for (int batch = 0; batch < 30; batch++) {
                CK(cudaStreamSynchronize(s));
                auto t = std::chrono::steady_clock::now();
                for (int i = 0; i < 20; i++) launch(which);
                host.push_back(us_since(t) / 20);
            }
            for (int i = 0; i < 200; i++) {
                CK(cudaStreamSynchronize(s));
                CK(cudaEventRecord(e0, s));
                launch(which);
                CK(cudaEventRecord(e1, s));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                idle.push_back(ms * 1e3);
            }
            printf("{\"grid\": \"%s\", \"launch\": \"%s\", \"host_us\": %.2f, \"idle_us\": %.2f}\n", g.name,
                   names[which], median(host), median(idle));
        }
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
    }
    return 0;
}
