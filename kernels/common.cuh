// Shared definitions of symm's CUDA kernels: fixed-width types, the
// asynchronous error record, memory-model primitives and the signal
// operations on symmetric signal pads.
//
// Build model: build.rs compiles each kernels/*.cu as its own translation
// unit into its own fatbin (one module each at run time), while the
// run-time NVRTC fallback compiles all of them as ONE unit, with these
// files supplied as in-memory headers. Hence:
//   * kernel and helper names must be unique across all kernels/*.cu;
//   * no __device__ globals shared between .cu files (each module would
//     get a copy of its own);
//   * nothing here may include a system or toolkit header under NVRTC (no
//     <cstdint>, no <cuda/atomic>): atomics are written as inline PTX.
//   * Targets are sm_80 and newer (the .sem/.scope PTX qualifiers need sm_70).
#pragma once

#if defined(__CUDACC_RTC__)
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

// ---------------------------------------------------------------------------
// Asynchronous error record.
//
// One per rank (per group), in host-visible memory: pinned host memory
// allocated with cuMemHostAlloc(CU_MEMHOSTALLOC_DEVICEMAP), whose device
// pointer (cuMemHostGetDevicePointer) is passed to the kernels as `err`.
// The host zeroes it before first use and to clear an error.
//
// C layout (mirror in Rust with #[repr(C)]), 32 bytes, align 8:
//   offset  0  uint32_t status     SYMM_ASYNC_* code; 0 = no error
//   offset  4  uint32_t published  0, then 1 once the fields below are final
//   offset  8  int32_t  rank       the rank that recorded the error
//   offset 12  int32_t  peer       the peer it was waiting for
//   offset 16  int32_t  channel    the signal channel
//   offset 20  uint32_t kind       SYMM_SIGNAL_KIND_* (put or wait)
//   offset 24  uint64_t waited_ns  how long it waited before giving up
//
// Protocol: the first failure wins. A kernel claims the record with a
// system-scope CAS of `status` from 0 to its code; only the winner writes
// the other fields, then __threadfence_system(), then a release store of
// `published` = 1. A host thread polling without synchronising the stream
// must see `published` == 1 (read it after `status`) before trusting
// rank/peer/channel/kind/waited_ns; after a stream or event sync all fields
// are final. While `status` != 0, every signal wait of the group gives up
// within about SYMM_ERR_POLL_NS (1 ms) instead of waiting for its own timeout, so
// the pads are then in an undefined state: the group must be torn down (or
// its pads zeroed on every rank) before signals are used again.
// ---------------------------------------------------------------------------
struct symm_async_error {
    uint32_t status;
    uint32_t published;
    int32_t rank;
    int32_t peer;
    int32_t channel;
    uint32_t kind;
    uint64_t waited_ns;
};

// Values of symm_async_error::status.
#define SYMM_ASYNC_OK 0u
#define SYMM_ASYNC_TIMEOUT 1u      // a put or wait ran past its timeout
#define SYMM_ASYNC_INVALID_ARG 2u  // rank/peer/world out of range
// 3 is the host's (the group failed and stopped its kernels).
#define SYMM_ASYNC_MISMATCH 4u     // a peer signalled from another call (its tag)

// Values of symm_async_error::kind.
#define SYMM_SIGNAL_KIND_NONE 0u
#define SYMM_SIGNAL_KIND_PUT 1u   // waiting for the peer to consume our previous signal
#define SYMM_SIGNAL_KIND_WAIT 2u  // waiting for the peer's signal to arrive
#define SYMM_SIGNAL_KIND_VALUE 3u // waiting for a 32-bit flag to reach a value

// A timeout of 0 does NOT mean "wait forever" (a kernel that never returns
// hangs the context): it means this default, 60 s.
#define SYMM_DEFAULT_TIMEOUT_NS 60000000000ull

// How often a spinning wait re-reads the error record, first after one
// interval. It is a read of host memory over PCIe, and such reads slow the
// whole SM: one thread per CTA waiting with a read every 20 us made the
// fused reduce-scatter's other warps 2.8 x slower on an H100. A failure elsewhere is noticed within 1 ms, which is
// far below any timeout.
#define SYMM_ERR_POLL_NS 1000000ull

// Longest pause between two polls of a signal slot.
#define SYMM_MAX_BACKOFF_NS 256u

// ---------------------------------------------------------------------------
// Memory-model primitives (PTX ISA 6.0+, sm_70+). Generic addressing, so they
// work on device memory (VMM, peers' mappings) and mapped host memory alike.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ uint64_t symm_globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __device__ __forceinline__ uint32_t symm_ld_relaxed_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ uint32_t symm_ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void symm_st_relaxed_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ void symm_st_release_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Compare-and-swap with the given ordering and scope ("release.sys", ...);
// returns the old value (success iff it equals `expected`).
#define SYMM_DEFINE_CAS(NAME, ORDER_SCOPE)                                                              \
    static __device__ __forceinline__ uint32_t NAME(uint32_t* p, uint32_t expected, uint32_t desired) { \
        uint32_t old;                                                                                   \
        asm volatile("atom." ORDER_SCOPE ".cas.b32 %0, [%1], %2, %3;"                                   \
                     : "=r"(old)                                                                        \
                     : "l"(p), "r"(expected), "r"(desired)                                              \
                     : "memory");                                                                       \
        return old;                                                                                     \
    }
SYMM_DEFINE_CAS(symm_cas_release_sys, "release.sys")
SYMM_DEFINE_CAS(symm_cas_acquire_sys, "acquire.sys")
// Device scope: for the error record, which is host memory mapped into one
// device. System-scoped atomics on host memory need host-native atomics
// (which PCIe-attached GPUs lack; compute-sanitizer flags them); only this
// device's threads race for the record, so device scope is what it needs.
SYMM_DEFINE_CAS(symm_cas_release_gpu, "release.gpu")
#undef SYMM_DEFINE_CAS

// ---------------------------------------------------------------------------
// Error recording.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ bool symm_error_pending(symm_async_error* err) {
    return symm_ld_relaxed_sys(&err->status) != SYMM_ASYNC_OK;
}

// Records a failure unless one is already recorded (the first one wins).
static __device__ void symm_record_error(symm_async_error* err, uint32_t code, int rank, int peer,
                                         int channel, uint32_t kind, uint64_t waited_ns) {
    if (symm_cas_release_gpu(&err->status, SYMM_ASYNC_OK, code) != SYMM_ASYNC_OK) {
        return;
    }
    symm_st_relaxed_sys((uint32_t*)&err->rank, (uint32_t)rank);
    symm_st_relaxed_sys((uint32_t*)&err->peer, (uint32_t)peer);
    symm_st_relaxed_sys((uint32_t*)&err->channel, (uint32_t)channel);
    symm_st_relaxed_sys(&err->kind, kind);
    asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(&err->waited_ns), "l"(waited_ns) : "memory");
    __threadfence_system();
    symm_st_release_sys(&err->published, 1u);
}

// ---------------------------------------------------------------------------
// Signal pads: uint32 slots pad[channel][src_rank]; `pads[r]` is rank r's
// pad as mapped in this process.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ uint32_t* symm_signal_slot(const uint64_t* pads, int pad_rank,
                                                            int world, int channel, int src_rank) {
    uint32_t* pad = (uint32_t*)pads[pad_rank];
    return pad + (uint64_t)channel * (uint64_t)world + (uint64_t)src_rank;
}

static __device__ __forceinline__ bool symm_args_valid(int rank, int world, int peer) {
    return world > 0 && rank >= 0 && rank < world && peer >= 0 && peer < world;
}

// Spins until the CAS of *slot from `from` to `to` succeeds (true), the
// timeout expires (records SYMM_ASYNC_TIMEOUT, false), or another failure is
// already recorded (false). `release` selects release (put) or acquire
// (wait) ordering. A wait that finds a value other than 0 and `from` (a
// peer's signal from another call) records SYMM_ASYNC_MISMATCH (false).
// The fast path is a single CAS.
static __device__ bool symm_spin_cas(uint32_t* slot, uint32_t from, uint32_t to, bool release,
                                     uint64_t timeout_ns, symm_async_error* err, int rank, int peer,
                                     int channel, uint32_t kind) {
    if (timeout_ns == 0) {
        timeout_ns = SYMM_DEFAULT_TIMEOUT_NS;
    }
    const uint64_t start = symm_globaltimer_ns();
    uint64_t next_err_poll = start + SYMM_ERR_POLL_NS;
    uint32_t backoff = 0;
    for (;;) {
        uint32_t old = release ? symm_cas_release_sys(slot, from, to)
                               : symm_cas_acquire_sys(slot, from, to);
        if (old == from) {
            return true;
        }
        if (!release && old != 0u) {
            symm_record_error(err, SYMM_ASYNC_MISMATCH, rank, peer, channel, kind, 0);
            return false;
        }
        const uint64_t now = symm_globaltimer_ns();
        if (now - start >= timeout_ns) {
            symm_record_error(err, SYMM_ASYNC_TIMEOUT, rank, peer, channel, kind, now - start);
            return false;
        }
        if (now >= next_err_poll) {
            if (symm_error_pending(err)) {
                return false;
            }
            next_err_poll = now + SYMM_ERR_POLL_NS;
        }
        if (backoff != 0) {
            __nanosleep(backoff);
        }
        backoff = backoff == 0 ? 8u : (backoff < SYMM_MAX_BACKOFF_NS ? backoff * 2u : backoff);
    }
}

// Signals `peer` on `channel`: waits until our slot in the peer's pad,
// pads[peer][channel][rank], is free (0), then sets it to `tag` (the call's,
// never 0) with release semantics at system scope, so this thread's earlier
// writes (and, with the caller's fence, the block's) are visible to the peer
// once it sees the flag.
static __device__ bool symm_signal_put(const uint64_t* pads, int rank, int world, int peer,
                                       int channel, uint32_t tag, uint64_t timeout_ns,
                                       symm_async_error* err) {
    uint32_t* slot = symm_signal_slot(pads, peer, world, channel, rank);
    return symm_spin_cas(slot, 0u, tag, true, timeout_ns, err, rank, peer, channel,
                         SYMM_SIGNAL_KIND_PUT);
}

// Waits for `peer`'s signal on `channel`: CAS of our own slot
// pads[rank][channel][peer] from `tag` back to 0 with acquire semantics at
// system scope (resetting it makes the pad reusable, e.g. under graph
// replay). Another tag there means the peer is in another call: recorded as
// SYMM_ASYNC_MISMATCH (false), the slot left as it is.
static __device__ bool symm_signal_wait(const uint64_t* pads, int rank, int world, int peer,
                                        int channel, uint32_t tag, uint64_t timeout_ns,
                                        symm_async_error* err) {
    uint32_t* slot = symm_signal_slot(pads, rank, world, channel, peer);
    return symm_spin_cas(slot, tag, 0u, false, timeout_ns, err, rank, peer, channel,
                         SYMM_SIGNAL_KIND_WAIT);
}
