// Does a copy run on a copy engine or on the SMs? Times device-to-device
// copies (same GPU, and to/from GPU 1 when there is one) alone and beside
// a kernel that occupies every SM (one block per SM, sleeping), issued
// with cudaMemcpyAsync and with cudaMemcpyBatchAsync's
// cudaMemcpyFlagPreferOverlapWithCompute (CUDA 12.8+). A copy that runs on
// the SMs waits for them (or crawls on what is left); a copy engine does
// not care. With two GPUs it also pulls from GPU 1 through a VMM mapping
// (cuMemCreate on GPU 1, mapped with access for GPU 0), as symm maps peers.
//   nvcc -O2 -arch=native copy_engine_probe.cu -lcuda -o probe && ./probe [MB]
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include <unistd.h>

#include "cuda_check.h"

// Holds its SM for `ns` nanoseconds (a stand-in for a persistent matmul).
__global__ void occupy(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

enum Method { PLAIN, BATCH_CE, BATCH_HINTED, PITCHED, METHODS };

static void copy(void* dst, const void* src, size_t bytes, Method m, cudaStream_t s) {
    if (m == PLAIN) {
        CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
        return;
    }
    if (m == PITCHED) {  // rows of 64 KiB: a 2D copy
        const size_t w = 64 << 10;
        CK(cudaMemcpy2DAsync(dst, w, src, w, w, bytes / w, cudaMemcpyDefault, s));
        return;
    }
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    if (m == BATCH_HINTED) {  // where source and destination live
        cudaPointerAttributes pa;
        CK(cudaPointerGetAttributes(&pa, src));
        attr.srcLocHint = {cudaMemLocationTypeDevice, pa.device};
        CK(cudaPointerGetAttributes(&pa, dst));
        attr.dstLocHint = {cudaMemLocationTypeDevice, pa.device};
    }
    void* dsts[1] = {dst};
    void* srcs[1] = {const_cast<void*>(src)};
    size_t sizes[1] = {bytes};
    size_t idx = 0;
    CK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &idx, 1, s));
}

// ms of one copy on stream `s`, with every SM of device `busy` (or none,
// if busy < 0) occupied for 50 ms from just before it.
static float timed(void* dst, const void* src, size_t bytes, Method m, int busy, cudaStream_t s,
                   cudaStream_t* other) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    if (busy >= 0) {
        int dev, sms;
        CK(cudaGetDevice(&dev));
        CK(cudaSetDevice(busy));
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, busy));
        // Two blocks of 1024 threads fill an SM's 2048 thread slots, so no
        // other block (a copy kernel's) can be resident beside them.
        occupy<<<sms * 2, 1024, 0, other[busy]>>>(50000000ull);
        CK(cudaGetLastError());
        CK(cudaSetDevice(dev));
        usleep(2000);  // let the blocks land before the copy is issued
    }
    CK(cudaEventRecord(a, s));
    copy(dst, src, bytes, m, s);
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaDeviceSynchronize());
    if (busy >= 0) {
        CK(cudaSetDevice(busy));
        CK(cudaDeviceSynchronize());
        CK(cudaSetDevice(0));
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return ms;
}

#define CU(x)                                                           \
    do {                                                                \
        CUresult r = (x);                                               \
        if (r != CUDA_SUCCESS) {                                        \
            const char* m = "";                                         \
            cuGetErrorString(r, &m);                                    \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, m); \
            exit(1);                                                    \
        }                                                               \
    } while (0)

// `bytes` of GPU `owner`'s memory (VMM), mapped for both GPUs: what a
// symm peer mapping is, in one process.
static void* vmm_on(int owner, size_t bytes) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, owner};
    size_t gran = 0;
    CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    bytes = (bytes + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle h;
    CU(cuMemCreate(&h, bytes, &prop, 0));
    CUdeviceptr p;
    CU(cuMemAddressReserve(&p, bytes, 0, 0, 0));
    CU(cuMemMap(p, bytes, 0, h, 0));
    CUmemAccessDesc access[2] = {};
    for (int d = 0; d < 2; d++) {
        access[d].location = {CU_MEM_LOCATION_TYPE_DEVICE, d};
        access[d].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    CU(cuMemSetAccess(p, bytes, access, 2));
    return (void*)p;
}

int main(int argc, char** argv) {
    size_t mb = argc > 1 ? atoi(argv[1]) : 64;
    size_t bytes = mb << 20;
    int ndev = 0;
    CK(cudaGetDeviceCount(&ndev));
    cudaStream_t other[2];
    void *x0, *y0, *x1 = nullptr;
    for (int d = (ndev >= 2 ? 1 : 0); d >= 0; d--) {
        CK(cudaSetDevice(d));
        CK(cudaStreamCreateWithFlags(&other[d], cudaStreamNonBlocking));
    }
    CK(cudaSetDevice(0));
    CK(cudaMalloc(&x0, bytes));
    CK(cudaMalloc(&y0, bytes));
    CK(cudaMemset(x0, 1, bytes));
    if (ndev >= 2) {
        CK(cudaDeviceEnablePeerAccess(1, 0));
        CK(cudaSetDevice(1));
        CK(cudaDeviceEnablePeerAccess(0, 0));
        CK(cudaMalloc(&x1, bytes));
        CK(cudaMemset(x1, 2, bytes));
        CK(cudaSetDevice(0));
    }
    void* v1 = nullptr;
    if (ndev >= 2) {
        v1 = vmm_on(1, bytes);
        CK(cudaMemset(v1, 3, bytes));
        CK(cudaDeviceSynchronize());
    }
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Control: a copy from pinned host memory is a copy engine's for sure.
    void* h;
    CK(cudaMallocHost(&h, bytes));
    for (int rep = 0; rep < 2; rep++) timed(y0, h, bytes, PLAIN, -1, s, other);
    printf("{\"copy\": \"pinned host to GPU\", \"method\": \"cudaMemcpyAsync\", \"MB\": %zu, \"idle_ms\": %.4f, "
           "\"sms_busy_ms\": %.4f}\n",
           mb, timed(y0, h, bytes, PLAIN, -1, s, other), timed(y0, h, bytes, PLAIN, 0, s, other));
    const char* names[METHODS] = {"cudaMemcpyAsync", "cudaMemcpyBatchAsync(PreferOverlapWithCompute)",
                                  "cudaMemcpyBatchAsync(PreferOverlapWithCompute, location hints)",
                                  "cudaMemcpy2DAsync(64 KiB rows)"};
    for (int m = PLAIN; m < METHODS; m++) {
        for (int rep = 0; rep < 2; rep++) timed(y0, x0, bytes, (Method)m, -1, s, other);  // warm up
        float idle = timed(y0, x0, bytes, (Method)m, -1, s, other);
        float busy = timed(y0, x0, bytes, (Method)m, 0, s, other);
        printf("{\"copy\": \"same GPU\", \"method\": \"%s\", \"MB\": %zu, \"idle_ms\": %.4f, \"sms_busy_ms\": %.4f}\n",
               names[m], mb, idle, busy);
        if (x1) {
            float pidle = timed(y0, x1, bytes, (Method)m, -1, s, other);
            float pbusy = timed(y0, x1, bytes, (Method)m, 0, s, other);
            float pbusy1 = timed(y0, x1, bytes, (Method)m, 1, s, other);
            printf("{\"copy\": \"pull from GPU 1\", \"method\": \"%s\", \"MB\": %zu, \"idle_ms\": %.4f, "
                   "\"sms_busy_ms\": %.4f, \"peer_sms_busy_ms\": %.4f}\n",
                   names[m], mb, pidle, pbusy, pbusy1);
        }
        if (v1 && m != PITCHED) {
            float vidle = timed(y0, v1, bytes, (Method)m, -1, s, other);
            float vbusy = timed(y0, v1, bytes, (Method)m, 0, s, other);
            printf("{\"copy\": \"pull from GPU 1 through a VMM mapping\", \"method\": \"%s\", \"MB\": %zu, "
                   "\"idle_ms\": %.4f, \"sms_busy_ms\": %.4f}\n",
                   names[m], mb, vidle, vbusy);
        }
    }
    return 0;
}
