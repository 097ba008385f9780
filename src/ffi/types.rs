//! Types that appear in `include/symm.h`.
//!
//! Enumerations are `int32_t` typedefs with named constants rather than C
//! enums: a value a caller makes up is then a checked error, not undefined
//! behaviour on the Rust side, and the ABI size is fixed.

use std::ffi::{c_char, c_int, c_void};

/// Result of every symm call. `SYMM_SUCCESS` is 0; on any other value,
/// `symm_last_error()` describes what happened.
pub type symm_status_t = i32;
pub const SYMM_SUCCESS: symm_status_t = 0;
/// An argument is NULL, out of range or malformed. Nothing was changed.
pub const SYMM_ERROR_INVALID_ARGUMENT: symm_status_t = 1;
/// A handle is NULL, destroyed, or of another type.
pub const SYMM_ERROR_INVALID_HANDLE: symm_status_t = 2;
/// Valid, but not supported by this build, backend or device.
pub const SYMM_ERROR_UNSUPPORTED: symm_status_t = 3;
/// A peer did not arrive in time; the message names it.
pub const SYMM_ERROR_TIMEOUT: symm_status_t = 4;
/// Ranks could not find or talk to each other.
pub const SYMM_ERROR_BOOTSTRAP: symm_status_t = 5;
/// Ranks passed arguments that disagree (sizes, shapes, world size...).
pub const SYMM_ERROR_MISMATCH: symm_status_t = 6;
/// Out of device or host memory.
pub const SYMM_ERROR_OUT_OF_MEMORY: symm_status_t = 7;
/// The CUDA driver or a CUDA library failed.
pub const SYMM_ERROR_CUDA: symm_status_t = 8;
/// No CUDA driver, or no such device.
pub const SYMM_ERROR_NO_DEVICE: symm_status_t = 9;
/// An operating-system call failed.
pub const SYMM_ERROR_SYSTEM: symm_status_t = 10;
/// Another rank failed the collective this call took part in.
pub const SYMM_ERROR_REMOTE: symm_status_t = 11;
/// A bug in symm; please report it with the message.
pub const SYMM_ERROR_INTERNAL: symm_status_t = 12;
/// The group is no longer usable: it failed earlier, on this rank or on a
/// peer (a timeout, a peer's failure, a device error, an operation left
/// half done), or `symm_group_abort` was called. Every later operation of
/// the group returns this; the message quotes the first failure. Destroy
/// the group and form a new one.
pub const SYMM_ERROR_ABORTED: symm_status_t = 13;

/// Which memory backend a group uses.
pub type symm_backend_t = i32;
/// CUDA when a driver and the requested device exist, else host.
pub const SYMM_BACKEND_AUTO: symm_backend_t = 0;
pub const SYMM_BACKEND_CUDA: symm_backend_t = 1;
/// Shared host memory; operations run on CPUs and ignore streams.
pub const SYMM_BACKEND_HOST: symm_backend_t = 2;

/// Group flag: several ranks may share one CUDA device (for testing). Such
/// ranks must each call on a stream of their own: on one stream (the
/// legacy default stream of two threads) a rank's wait for a peer would
/// hold back the peer's signal queued behind it until the timeout.
pub const SYMM_GROUP_ALLOW_SHARED_DEVICE: u32 = 1;
/// Group flag: the ranks check that they agree on an operation's arguments
/// on every call. By default a call whose arguments all ranks agreed on
/// before skips the check (one bootstrap round trip); env
/// `SYMM_CHECK_ARGS=always` sets this flag too.
pub const SYMM_GROUP_CHECK_ARGS_ALWAYS: u32 = 2;

/// Number of signal channels of every handle (valid channels are 0..15).
pub const SYMM_SIGNAL_CHANNELS: c_int = 16;

/// Options for forming a group. Initialize with `SYMM_GROUP_CONFIG_INIT`;
/// fields are only ever appended, and `struct_size` tells symm which exist.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_group_config_t {
    /// `sizeof(symm_group_config_t)` as the caller compiled it.
    pub struct_size: usize,
    /// `SYMM_BACKEND_*`; `SYMM_BACKEND_AUTO` defers to env `SYMM_BACKEND`.
    pub backend: symm_backend_t,
    /// How long any rank waits for the others, in ms; 0 = env
    /// `SYMM_TIMEOUT_MS`, else 300000.
    pub timeout_ms: i32,
    /// `SYMM_GROUP_*` flags.
    pub flags: u32,
}

/// Names an embedded bootstrap store: its address and a secret. Made by
/// `symm_get_unique_id` on one rank and passed to the others.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct symm_unique_id_t {
    pub internal: [c_char; 128],
}

/// A caller-provided bootstrap (MPI, a torch store, ...). Callbacks return
/// 0 on success and must return nonzero rather than wait forever.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct symm_bootstrap_t {
    /// `sizeof(symm_bootstrap_t)`.
    pub struct_size: usize,
    /// Passed back to the callbacks unchanged.
    pub ctx: *mut c_void,
    /// Gathers `bytes_per_rank` bytes from every rank into `recv`, in rank order.
    pub allgather: Option<
        unsafe extern "C" fn(ctx: *mut c_void, send: *const c_void, recv: *mut c_void, bytes_per_rank: usize) -> c_int,
    >,
    /// Optional (may be NULL). symm's collectives all carry data (at least
    /// each rank's success or failure), so they run on `allgather`; symm
    /// does not call `barrier` at present.
    pub barrier: Option<unsafe extern "C" fn(ctx: *mut c_void) -> c_int>,
}

/// A group of ranks sharing symmetric memory.
pub struct symm_group {
    _opaque: [u8; 0],
}
/// One rank's symmetric allocation.
pub struct symm_buffer {
    _opaque: [u8; 0],
}
/// The rendezvoused view of every rank's copy of one buffer.
pub struct symm_handle {
    _opaque: [u8; 0],
}

pub type symm_group_t = *mut symm_group;
pub type symm_buffer_t = *mut symm_buffer;
pub type symm_handle_t = *mut symm_handle;

/// Element type of a tensor.
pub type symm_dtype_t = i32;
pub const SYMM_DTYPE_F32: symm_dtype_t = 1;
pub const SYMM_DTYPE_BF16: symm_dtype_t = 2;
pub const SYMM_DTYPE_F16: symm_dtype_t = 3;
/// 8-bit floats (OCP E4M3 as `torch.float8_e4m3fn`: bias 7, no
/// infinities, NaN 0x7f/0xff; and E5M2 as `torch.float8_e5m2`). Copied by
/// `symm_lc_allgather` and gathered by `symm_fused_ag_mm`; matmul inputs
/// with scales, and outputs of such matmuls (see `symm_ag_mm_options_t`).
pub const SYMM_DTYPE_FP8_E4M3: symm_dtype_t = 4;
pub const SYMM_DTYPE_FP8_E5M2: symm_dtype_t = 5;
/// Integers (two's complement; `torch.int8`, `uint8`, `int32`, `int64`).
/// Copied by `symm_lc_allgather` and reduced by `symm_all_reduce`, exactly
/// in the element type: `SYMM_REDUCE_SUM` wraps on overflow (modulo 2^bits,
/// as NCCL and torch do), `SYMM_REDUCE_AVG` divides that wrapped sum by the
/// world size, truncating toward zero (as NCCL's `ncclAvg`). Never matmul
/// operands or outputs, and not taken by `symm_all_reduce_rmsnorm`.
pub const SYMM_DTYPE_INT8: symm_dtype_t = 6;
pub const SYMM_DTYPE_UINT8: symm_dtype_t = 7;
pub const SYMM_DTYPE_INT32: symm_dtype_t = 8;
pub const SYMM_DTYPE_INT64: symm_dtype_t = 9;

/// Most dimensions a tensor may have.
pub const SYMM_MAX_DIMS: usize = 8;

/// A tensor the caller owns: where its elements are and how they are laid
/// out (PyTorch-style sizes and element strides). For an operation's
/// outputs symm writes the elements, never the descriptor.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_tensor_t {
    /// The first element, aligned to the element size: device memory of
    /// the group's device on CUDA, host memory on the host backend.
    pub data: *mut c_void,
    /// `SYMM_DTYPE_*`.
    pub dtype: symm_dtype_t,
    /// Number of dimensions, 1 to `SYMM_MAX_DIMS`.
    pub ndim: i32,
    /// Sizes of the first `ndim` dimensions, each at least 1.
    pub shape: [i64; SYMM_MAX_DIMS],
    /// Strides in elements of the first `ndim` dimensions, each at least 0
    /// (row-major contiguous: `strides[i]` = product of `shape[i+1..]`).
    pub strides: [i64; SYMM_MAX_DIMS],
}

/// How `symm_mm_rs` and `symm_all_reduce` combine the ranks' values.
pub type symm_reduce_op_t = i32;
pub const SYMM_REDUCE_SUM: symm_reduce_op_t = 0;
/// The sum divided by the world size.
pub const SYMM_REDUCE_AVG: symm_reduce_op_t = 1;

/// The algorithm chosen for an operation.
pub type symm_algorithm_t = i32;
/// Let symm choose (env `SYMM_ALGO`, else the cost model); the default of
/// the options' `algorithm`.
pub const SYMM_ALGORITHM_AUTO: symm_algorithm_t = -1;
/// Communicate everything, then one matmul (or matmul, then reduce).
pub const SYMM_ALGORITHM_SEQUENTIAL: symm_algorithm_t = 0;
/// One matmul piece per rank, communication overlapped with the matmul.
pub const SYMM_ALGORITHM_PIPELINED: symm_algorithm_t = 1;
/// One persistent matmul kernel over the whole problem whose tiles wait for
/// gathered rows or push reduce-scatter partials (Hopper, sm_90a; bf16/f16,
/// gather or scatter dim 0, B K-major, i.e. a Linear weight's transpose;
/// the query assumes that layout, other layouts run the pipelined path).
pub const SYMM_ALGORITHM_FUSED: symm_algorithm_t = 2;
/// All-reduce: every rank reads every rank's data and reduces all of it
/// (one trip over the links; the lowest latency, for small messages).
pub const SYMM_ALGORITHM_ONE_SHOT: symm_algorithm_t = 3;
/// All-reduce: reduce-scatter then all-gather through the peers' buffers
/// (half the traffic at two ranks; for large messages).
pub const SYMM_ALGORITHM_TWO_SHOT: symm_algorithm_t = 4;

/// Options of `symm_fused_ag_mm`. Initialize with `SYMM_AG_MM_OPTIONS_INIT`;
/// fields are only ever appended, and `struct_size` tells symm which exist.
///
/// The fields make the matmuls scaled fp8 ones, as PyTorch's
/// `fused_all_gather_scaled_matmul` and `torch._scaled_mm`:
/// `outs[i] = (A * a_scale) @ (bs[i] * b_scales[i]) (+ biases[i])`, products
/// summed in f32. With an fp8 `a_shard` (`SYMM_DTYPE_FP8_E4M3` or `_E5M2`)
/// `a_scale` and `b_scales` are required; with any other dtype they must be
/// NULL. Each `bs[i]` is fp8 too (not both operands E5M2, which cuBLASLt
/// cannot multiply) and column-major, i.e. K-major: strides `[1, ld]` with
/// `ld` a multiple of 16 and 16-byte aligned data, as `W.t()` of a
/// row-major `[N, K]` weight (any other layout: `SYMM_ERROR_UNSUPPORTED`,
/// on every backend, naming this layout). K and every N_i must be
/// multiples of 16. `a_shard` may have any strides. The output dtype is
/// each output tensor's own `dtype`: bf16, f16, f32, or fp8 (E4M3 or E5M2;
/// torch's default for fp8 operands), then `outs[i] = fp8(((A * a_scale) @
/// (bs[i] * b_scales[i]) (+ biases[i])) * result_scales[i])` with the
/// product in f32, rounded once to nearest even, saturated to the format's
/// largest finite value (E4M3 448, E5M2 57344; NaN stays NaN), as
/// cuBLASLt writes an fp8 D with its D scale, the meaning torch documents
/// for `scale_result` (torch 2.11's `_scaled_mm` ignores it on CUDA). The
/// f32 product carries the fp8 tensor cores' accumulation error (up to
/// about 2^-12 of the sum of an element's terms' magnitudes), which the
/// rounding can move by one code. fp8 outputs cost a pass over an f32
/// product in the workspace and never run the fused kernel.
///
/// Scales are f32. Tensor-wise when `a_scale` and every `b_scales[i]` hold
/// one element (any shape, e.g. `[1]`): `a_scale` is this rank's and scales
/// the whole gathered A, so every rank should pass the same value (as in
/// PyTorch). Otherwise row-wise: `a_scale` has `a_shard`'s shape with the
/// last dimension 1 (one scale per row of the shard, any strides) and is
/// gathered along with the rows; `b_scales[i]` is a contiguous `[1, N_i]`.
/// Row-wise scales need `gather_dim` other than the last dimension, and on
/// CUDA cuBLASLt 12.9+ on compute capability 9.0+ (fp8 itself needs 8.9+).
/// Scales, like every tensor, are in the group's memory (device memory on
/// CUDA) and are read when the matmuls run.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_ag_mm_options_t {
    /// `sizeof(symm_ag_mm_options_t)` as the caller compiled it.
    pub struct_size: usize,
    /// Scale of `a_shard`; NULL unless `a_shard` is fp8.
    pub a_scale: *const symm_tensor_t,
    /// `num_b` scales, one per B; NULL unless `a_shard` is fp8.
    pub b_scales: *const symm_tensor_t,
    /// NULL, or `num_b` bias vectors `[N_i]` (contiguous, of `outs[i]`'s
    /// dtype, which must then be bf16 or f16; bf16 or f16 for an fp8
    /// output), added to each output after scaling; an entry whose `data`
    /// is NULL adds none. fp8 matmuls only.
    pub biases: *const symm_tensor_t,
    /// `SYMM_ALGORITHM_*` to run, or `SYMM_ALGORITHM_AUTO` (the default,
    /// also for callers whose struct ends before this field): env
    /// `SYMM_ALGO`, else the cost model's choice. Every rank passes the
    /// same (else `SYMM_ERROR_MISMATCH`); `SYMM_ALGORITHM_FUSED` where the
    /// fused kernel cannot run the call is `SYMM_ERROR_UNSUPPORTED`.
    pub algorithm: symm_algorithm_t,
    /// NULL (also for callers whose struct ends before this field), or
    /// `num_b` result scales, one per output as torch's `result_scales`:
    /// each a one-element f32 tensor that multiplies an fp8 output before
    /// it is rounded; an entry whose `data` is NULL scales by 1. Only fp8
    /// outputs take one (else `SYMM_ERROR_INVALID_ARGUMENT`).
    pub result_scales: *const symm_tensor_t,
}

/// Options of `symm_mm_rs`. Initialize with `SYMM_MM_RS_OPTIONS_INIT`.
///
/// As `symm_ag_mm_options_t`, the fields make the matmul a scaled fp8 one,
/// as PyTorch's `fused_scaled_matmul_reduce_scatter`: each rank's product
/// is `(a * a_scale) @ (b * b_scale) (+ bias)`, then reduced and scattered.
/// The same rules hold: fp8 `a` needs both scales, `b` fp8 and
/// column-major, K and N multiples of 16 (N / world when `scatter_dim` is
/// the last dimension), `out` bf16, f16, f32 or fp8. Tensor-wise:
/// one-element scales. Row-wise: `a_scale` has `a`'s shape with the last
/// dimension 1, `b_scale` is a contiguous `[1, N]`.
///
/// An fp8 `out` receives the reduction rounded once: each rank's product
/// in f32 (without the bias) travels and is summed in f32, then `out =
/// fp8((sum + world * bias) * result_scale)` (`SYMM_REDUCE_AVG`: `(sum /
/// world + bias) * result_scale`), rounded to nearest even and saturated
/// as in `symm_ag_mm_options_t`; never the fused kernel. The partials are
/// f32, so twice the bytes of bf16 ones cross the links.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_mm_rs_options_t {
    /// `sizeof(symm_mm_rs_options_t)` as the caller compiled it.
    pub struct_size: usize,
    /// Scale of `a`; NULL unless `a` is fp8.
    pub a_scale: *const symm_tensor_t,
    /// Scale of `b`; NULL unless `a` is fp8.
    pub b_scale: *const symm_tensor_t,
    /// NULL, or a contiguous `[N]` of `out`'s dtype (bf16 or f16; bf16 or
    /// f16 for an fp8 `out`) added to each rank's product, so that, as in
    /// PyTorch, `SYMM_REDUCE_SUM` includes it world times and
    /// `SYMM_REDUCE_AVG` once. fp8 only.
    pub bias: *const symm_tensor_t,
    /// `SYMM_ALGORITHM_*` to run, or `SYMM_ALGORITHM_AUTO` (the default);
    /// as in `symm_ag_mm_options_t`.
    pub algorithm: symm_algorithm_t,
    /// NULL (1; also for callers whose struct ends before this field), or
    /// a one-element f32 tensor multiplying an fp8 `out` before it is
    /// rounded, as torch's `result_scale`. Only for an fp8 `out`.
    pub result_scale: *const symm_tensor_t,
}

/// Options of `symm_all_reduce` and `symm_all_reduce_rmsnorm`. Initialize
/// with `SYMM_ALL_REDUCE_OPTIONS_INIT`; fields are only ever appended, and
/// `struct_size` tells symm which exist.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_all_reduce_options_t {
    /// `sizeof(symm_all_reduce_options_t)` as the caller compiled it.
    pub struct_size: usize,
    /// `SYMM_ALGORITHM_ONE_SHOT`, `SYMM_ALGORITHM_TWO_SHOT`, or
    /// `SYMM_ALGORITHM_AUTO` (the default: the cost model's choice by
    /// size and world, as `symm_plan_all_reduce` tells). Every rank passes
    /// the same (else `SYMM_ERROR_MISMATCH`).
    pub algorithm: symm_algorithm_t,
}

/// The XLA platform a device ordinal belongs to (`symm_xla_bind_device`).
pub type symm_xla_platform_t = i32;
/// XLA's CPU platform: devices are served by a group on the host backend.
pub const SYMM_XLA_PLATFORM_CPU: symm_xla_platform_t = 1;
/// XLA's CUDA platform: device ordinal = CUDA device of a cuda-backend group.
pub const SYMM_XLA_PLATFORM_CUDA: symm_xla_platform_t = 2;
