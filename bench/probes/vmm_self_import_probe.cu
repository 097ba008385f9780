// What cuMemImportFromShareableHandle does with an fd exported by the same
// process (two ranks of one process map each other's buffers this way):
// is the imported handle the exporter's own, and does releasing it (as
// symm's import does right after mapping) release the exporter's
// reference? Prints the handles, then whether the exporter's handle still
// exports, and whether a new allocation reuses its value.
//   nvcc -O2 vmm_self_import_probe.cu -lcuda -o probe && ./probe
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <unistd.h>

#define CK(x)                                                                 \
    do {                                                                      \
        CUresult r = (x);                                                     \
        if (r != CUDA_SUCCESS) {                                              \
            const char* s = nullptr;                                          \
            cuGetErrorString(r, &s);                                          \
            printf("%s -> %d (%s)\n", #x, (int)r, s ? s : "?");               \
        }                                                                     \
    } while (0)

static CUmemGenericAllocationHandle create(size_t bytes) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h = 0;
    CK(cuMemCreate(&h, bytes, &prop, 0));
    return h;
}

int main() {
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    const size_t bytes = 2 << 20;
    CUmemGenericAllocationHandle owner = create(bytes);
    int fd = -1;
    CK(cuMemExportToShareableHandle(&fd, owner, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CUmemGenericAllocationHandle imported = 0;
    CK(cuMemImportFromShareableHandle(&imported, (void*)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    printf("owner handle %#llx, imported handle %#llx: %s\n", (unsigned long long)owner,
           (unsigned long long)imported, owner == imported ? "the same" : "different");
    // Map the import, then release it as symm does.
    CUdeviceptr va = 0;
    CK(cuMemAddressReserve(&va, bytes, 0, 0, 0));
    CK(cuMemMap(va, bytes, 0, imported, 0));
    CK(cuMemRelease(imported));
    printf("released the imported handle once\n");
    int fd2 = -1;
    CUresult r = cuMemExportToShareableHandle(&fd2, owner, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    printf("the owner's handle exports again after that: %s (%d)\n", r == CUDA_SUCCESS ? "yes" : "no", (int)r);
    if (fd2 >= 0) close(fd2);
    CUmemGenericAllocationHandle next = create(bytes);
    printf("a new allocation's handle %#llx: %s the owner's\n", (unsigned long long)next,
           next == owner ? "REUSES" : "differs from");
    return 0;
}
