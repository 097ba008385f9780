//! The device-side all-reduce on CUDA (kernels/allreduce.cu): one launch
//! of the one-shot (LL lines, flag in the data) or the two-shot (chunks
//! with call-numbered flags) kernel per call, through the group's
//! all-reduce buffer (layout: `backend::AllReduceLayout`); and the add +
//! RMSNorm kernel, fused into the one-shot where rows are whole LL lines,
//! launched after the all-reduce otherwise. Integers take kernels of
//! their own that sum exactly in the element's width (no norm). And the
//! all-gather of the same buffer (`symm_ag_one_shot`): the one-shot's lines
//! placed into the output instead of summed; and its reduce-scatter
//! (`symm_rs_one_shot_*`): each chunk's lines to their rank only, summed there.

use super::gemm::GemmDtype;
use super::module::{arg, Kernels};
use super::sm90::gemm_dtype;
use crate::array::{Array, DType};
use crate::backend::{
    AddRmsNorm, AllGatherCall, AllReduceAlgorithm, AllReduceCall, AllReduceLayout, CallTag, ReduceScatterCall, Stream,
};
use crate::error::{err, Result};
use cudarc::driver::CudaFunction;
use std::ffi::c_void;

/// Threads per block (`SYMM_AR_THREADS`).
pub const AR_THREADS: u32 = 512;
/// Largest world the kernels take (`SYMM_AR_MAX_WORLD`).
pub const AR_MAX_WORLD: usize = AllReduceLayout::MAX_WORLD;

/// Mirror of `struct symm_ar_params`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ArParams {
    scratch: [u64; AR_MAX_WORLD],
    input: u64,
    output: u64,
    residual: u64,
    weight: u64,
    residual_out: u64,
    err: u64,
    n: u64,
    timeout_ns: u64,
    flags_off: u64,
    one_off: u64,
    one_slot: u64,
    two_off: u64,
    two_slot: u64,
    chunk_bytes: u64,
    partials_off: u64,
    tags_off: u64,
    rank: i32,
    world: i32,
    hidden: u32,
    scale: f32,
    eps: f32,
    divisor: u32,
    segments: u32,
    tag: u32,
}

/// Mirror of `struct symm_rmsnorm_params`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct NormParams {
    out: u64,
    residual_out: u64,
    x: u64,
    residual: u64,
    weight: u64,
    rows: u64,
    ld_out: u64,
    ld_residual_out: u64,
    ld_x: u64,
    ld_residual: u64,
    hidden: u32,
    eps: f32,
}

/// Most blocks one row of the fused norm is split over (`SYMM_AR_MAX_SEGMENTS`).
const MAX_SEGMENTS: usize = 8;

/// How one call's kernel is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cut {
    blocks: u32,
    /// The one-shot's fused norm: blocks per row.
    segments: u32,
    /// The two-shot's chunk.
    chunk_bytes: usize,
    /// Whether the kernel applies the norm itself (else a second kernel does).
    folds_norm: bool,
}

/// At most one block per SM (every block resident, so the waits always
/// end), at least 1. The one-shot: a line per thread; its norm folded in
/// where rows are whole 8-byte LL lines, a few rows split over several
/// blocks each (a row per block would leave most SMs idle while the others
/// read every line). The two-shot: a block per chunk group, its norm a
/// second kernel (folding it in, each block normalizing its chunks' rows one
/// after another, measured no faster on 2 x H200).
fn cut(call: &AllReduceCall, sm_count: u32) -> Cut {
    let bytes = call.n * call.dtype.size();
    let sms = (sm_count.max(1) as usize).min(AllReduceLayout::MAX_NORM_BLOCKS);
    let row = call.norm.as_ref().filter(|nm| nm.hidden <= u32::MAX as usize).map(|nm| nm.hidden * call.dtype.size());
    let plain = AllReduceLayout::chunk_bytes(bytes, call.world);
    match call.algorithm {
        AllReduceAlgorithm::OneShot => {
            let blocks = bytes.div_ceil(8).div_ceil(AR_THREADS as usize).clamp(1, sms);
            let folds_norm = row.is_some_and(|row| row > 0 && row % 8 == 0);
            let rows = if folds_norm { bytes / row.unwrap_or(1) } else { 0 };
            let segments = blocks.checked_div(rows).map_or(1, |s| s.clamp(1, MAX_SEGMENTS));
            let blocks = if segments > 1 { rows * segments } else { blocks.max(rows).min(sms) };
            Cut { blocks: blocks as u32, segments: segments as u32, chunk_bytes: plain, folds_norm }
        }
        AllReduceAlgorithm::TwoShot => {
            let groups = AllReduceLayout::groups_of(bytes, plain, call.world);
            let blocks = groups.clamp(1, sm_count.max(1) as usize) as u32;
            Cut { blocks, segments: 1, chunk_bytes: plain, folds_norm: false }
        }
    }
}

/// What every launch on the all-reduce buffer shares: the buffers, the
/// layout, this rank, the timeout; checked to hold `bytes` per rank.
struct Shared<'a> {
    rank: usize,
    world: usize,
    scratch: &'a [u64],
    scratch_bytes: usize,
    bytes: usize,
    timeout: std::time::Duration,
    tag: CallTag,
}

impl Shared<'_> {
    fn params(&self, err_ptr: u64) -> Result<ArParams> {
        let Shared { rank, world, scratch, scratch_bytes, bytes, timeout, tag } = *self;
        if world == 0 || world > AR_MAX_WORLD || rank >= world || scratch.len() != world {
            return Err(err!(Internal, "all-reduce kernel for rank {rank} of {world} with {} buffers", scratch.len()));
        }
        let layout = AllReduceLayout::of(scratch_bytes, world);
        if !layout.holds(bytes) {
            return Err(err!(Internal, "an all-reduce buffer of {scratch_bytes} bytes cannot hold {bytes} bytes"));
        }
        let mut p = ArParams {
            err: err_ptr,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            flags_off: layout.flags as u64,
            one_off: layout.one_shot as u64,
            one_slot: layout.one_shot_slot as u64,
            two_off: layout.two_shot as u64,
            two_slot: layout.two_shot_slot as u64,
            partials_off: AllReduceLayout::HEADER as u64,
            tags_off: AllReduceLayout::TAGS as u64,
            tag: tag.get(),
            rank: rank as i32,
            world: world as i32,
            scale: 1.0,
            divisor: 1,
            ..Default::default()
        };
        p.scratch[..world].copy_from_slice(scratch);
        Ok(p)
    }
}

fn params(call: &AllReduceCall, err_ptr: u64) -> Result<ArParams> {
    let size = call.dtype.size();
    let bytes = call.n * size;
    let divisor = u32::try_from(call.divisor).ok().filter(|&d| d >= 1);
    let Some(divisor) = divisor else {
        return Err(err!(Internal, "all-reduce divisor {}", call.divisor));
    };
    let shared = Shared {
        rank: call.rank,
        world: call.world,
        scratch: &call.scratch,
        scratch_bytes: call.scratch_bytes,
        bytes,
        timeout: call.timeout,
        tag: call.tag,
    };
    let mut p = shared.params(err_ptr)?;
    for (name, p) in [("input", call.input), ("output", call.output)] {
        if p == 0 || p % size as u64 != 0 {
            return Err(err!(Internal, "all-reduce {name} {p:#x} is NULL or misaligned"));
        }
    }
    (p.input, p.output, p.n, p.scale, p.divisor) = (call.input, call.output, call.n as u64, call.scale, divisor);
    p.chunk_bytes = AllReduceLayout::chunk_bytes(bytes, call.world) as u64;
    Ok(p)
}

/// The all-gather's parameters: `n` is the bytes per rank.
fn gather_params(call: &AllGatherCall, err_ptr: u64) -> Result<ArParams> {
    let shared = Shared {
        rank: call.rank,
        world: call.world,
        scratch: &call.scratch,
        scratch_bytes: call.scratch_bytes,
        bytes: call.bytes,
        timeout: call.timeout,
        tag: call.tag,
    };
    let mut p = shared.params(err_ptr)?;
    if call.input == 0 || call.output == 0 {
        return Err(err!(Internal, "all-gather input {:#x} or output {:#x} is NULL", call.input, call.output));
    }
    (p.input, p.output, p.n) = (call.input, call.output, call.bytes as u64);
    Ok(p)
}

/// Blocks of an all-gather: one thread per 8-byte line, at most one block
/// per SM (every block resident: each pushes all its lines before it
/// waits), at least 1.
fn gather_grid(bytes: usize, sm_count: u32) -> u32 {
    bytes.div_ceil(8).div_ceil(AR_THREADS as usize).clamp(1, sm_count.max(1) as usize) as u32
}

/// Enqueues the all-gather `call` on `stream`; `err_ptr` is the device's
/// error record. Nothing to move (0 bytes): no launch, on every rank alike.
pub fn all_gather(kernels: &Kernels, call: &AllGatherCall, err_ptr: u64, stream: Stream) -> Result<()> {
    if call.bytes == 0 {
        return Ok(());
    }
    let mut p = gather_params(call, err_ptr)?;
    let blocks = match call.algorithm {
        AllReduceAlgorithm::OneShot => gather_grid(call.bytes, kernels.sm_count),
        AllReduceAlgorithm::TwoShot => pieces_grid(call.bytes, kernels.sm_count),
    };
    let mut params: [*mut c_void; 1] = [arg(&mut p)];
    // SAFETY: one parameter, `struct symm_ar_params` by value (ArParams
    // mirrors it); the addresses are the caller's contiguous arrays and the
    // group's all-reduce buffers, live until the work completes.
    unsafe {
        kernels.launch(
            &kernels.all_gather[call.algorithm as usize],
            blocks,
            (AR_THREADS, 1, 1),
            stream,
            &mut params,
            "the all-gather kernel",
        )
    }
}

/// The reduce-scatter's parameters: `n` the elements per chunk, each
/// chunk whole lines in the one-shot slot; the input's chunks
/// `chunk_bytes` apart.
fn scatter_params(call: &ReduceScatterCall, err_ptr: u64) -> Result<ArParams> {
    call.check()?;
    let shared = Shared {
        rank: call.rank,
        world: call.world,
        scratch: &call.scratch,
        scratch_bytes: call.scratch_bytes,
        bytes: call.n * call.dtype.size(),
        timeout: call.timeout,
        tag: call.tag,
    };
    let mut p = shared.params(err_ptr)?;
    (p.input, p.output, p.n, p.scale) = (call.input, call.output, call.n as u64, call.scale);
    p.chunk_bytes = call.chunk_stride as u64;
    Ok(p)
}

/// Blocks of a reduce-scatter by pieces: one per piece of a chunk (as
/// `symm_rs_piece_bytes` cuts it), at most one per SM, at least 1.
fn pieces_grid(bytes: usize, sm_count: u32) -> u32 {
    let piece = bytes.div_ceil(RS_PIECES).max(RS_MIN_PIECE).next_multiple_of(16);
    bytes.div_ceil(piece).clamp(1, sm_count.max(1) as usize) as u32
}

/// `SYMM_RS_PIECES`, `SYMM_RS_MIN_PIECE` (kernels/allreduce.cu).
const RS_PIECES: usize = 128;
const RS_MIN_PIECE: usize = 4096;

/// Enqueues the reduce-scatter `call` on `stream` (nothing for empty
/// chunks, on every rank alike).
pub fn reduce_scatter(kernels: &Kernels, call: &ReduceScatterCall, err_ptr: u64, stream: Stream) -> Result<()> {
    if call.n == 0 {
        return Ok(());
    }
    let mut p = scatter_params(call, err_ptr)?;
    let dtype = gemm_dtype(call.dtype)?;
    let bytes = call.n * call.dtype.size();
    let blocks = match call.algorithm {
        AllReduceAlgorithm::OneShot => gather_grid(bytes, kernels.sm_count),
        AllReduceAlgorithm::TwoShot => pieces_grid(bytes, kernels.sm_count),
    };
    let mut params: [*mut c_void; 1] = [arg(&mut p)];
    // SAFETY: as in `all_gather`: `struct symm_ar_params` by value; the
    // caller's chunks and output, and the group's buffers, live until the
    // work completes.
    unsafe {
        kernels.launch(
            &kernels.reduce_scatter[call.algorithm as usize][dtype as usize],
            blocks,
            (AR_THREADS, 1, 1),
            stream,
            &mut params,
            "the reduce-scatter kernel",
        )
    }
}

/// The index of an integer dtype in `Kernels::all_reduce_int`.
pub fn int_index(dtype: DType) -> Option<usize> {
    match dtype {
        DType::I8 => Some(0),
        DType::U8 => Some(1),
        DType::I32 => Some(2),
        DType::I64 => Some(3),
        _ => None,
    }
}

/// The kernel for `call`'s algorithm and dtype.
fn kernel<'k>(kernels: &'k Kernels, call: &AllReduceCall) -> Result<&'k CudaFunction> {
    let a = call.algorithm as usize;
    match int_index(call.dtype) {
        Some(_) if call.norm.is_some() => Err(err!(Internal, "an rmsnorm of {} values", call.dtype)),
        Some(i) => Ok(&kernels.all_reduce_int[a][i]),
        None => Ok(&kernels.all_reduce[a][gemm_dtype(call.dtype)? as usize]),
    }
}

/// Enqueues `call` on `stream`; `err_ptr` is the device's error record.
pub fn all_reduce(kernels: &Kernels, call: &AllReduceCall, err_ptr: u64, stream: Stream) -> Result<()> {
    let cut = cut(call, kernels.sm_count);
    let f = kernel(kernels, call)?;
    let mut p = params(call, err_ptr)?;
    (p.chunk_bytes, p.segments) = (cut.chunk_bytes as u64, cut.segments);
    let fused = call.norm.as_ref().filter(|_| cut.folds_norm);
    if let Some(nm) = fused {
        (p.residual, p.weight, p.residual_out, p.hidden, p.eps) =
            (nm.residual, nm.weight, nm.residual_out, nm.hidden as u32, nm.eps);
    }
    let blocks = cut.blocks;
    let mut params: [*mut c_void; 1] = [arg(&mut p)];
    // SAFETY: one parameter, `struct symm_ar_params` by value (ArParams
    // mirrors it); the addresses are the caller's checked arrays and the
    // group's all-reduce buffers, live until the work completes.
    unsafe { kernels.launch(f, blocks, (AR_THREADS, 1, 1), stream, &mut params, "the all-reduce kernel")? };
    match (&call.norm, fused) {
        (Some(nm), None) => {
            // The sum is in `output` (out): normalize it there.
            let rows = call.n / nm.hidden;
            let m = |addr| Array::contiguous(addr, call.dtype, &[rows, nm.hidden]);
            let w = Array::contiguous(nm.weight, call.dtype, &[nm.hidden]);
            let out = m(call.output);
            let (residual_out, residual) = (m(nm.residual_out), m(nm.residual));
            let norm = AddRmsNorm {
                out: &out,
                residual_out: &residual_out,
                x: &out,
                residual: &residual,
                weight: &w,
                eps: nm.eps,
            };
            add_rms_norm(kernels, &norm, stream)
        }
        _ => Ok(()),
    }
}

/// `residual_out = x + residual`, `out = rmsnorm(residual_out) * weight`
/// (see `Backend::add_rms_norm`): matrices of unit column stride.
pub fn add_rms_norm(kernels: &Kernels, norm: &AddRmsNorm, stream: Stream) -> Result<()> {
    let AddRmsNorm { out, residual_out, x, residual, weight, eps } = *norm;
    let dtype: GemmDtype = gemm_dtype(x.dtype)?;
    let (rows, hidden) = (x.shape[0], x.shape[1]);
    let mats = [out, residual_out, x, residual];
    if mats.iter().any(|m| m.shape != x.shape || m.strides[1] != 1 || m.dtype != x.dtype)
        || weight.shape != [hidden]
        || !weight.is_contiguous()
        || weight.dtype != x.dtype
        || hidden > u32::MAX as usize
    {
        return Err(err!(Internal, "rmsnorm of {:?} with mismatched operands", x.shape));
    }
    if rows == 0 || hidden == 0 {
        return Ok(());
    }
    let ld = |m: &Array| m.strides[0].max(hidden) as u64;
    let mut p = NormParams {
        out: out.addr,
        residual_out: residual_out.addr,
        x: x.addr,
        residual: residual.addr,
        weight: weight.addr,
        rows: rows as u64,
        ld_out: ld(out),
        ld_residual_out: ld(residual_out),
        ld_x: ld(x),
        ld_residual: ld(residual),
        hidden: hidden as u32,
        eps,
    };
    let blocks = rows.min(4 * kernels.sm_count.max(1) as usize) as u32;
    let mut params: [*mut c_void; 1] = [arg(&mut p)];
    // SAFETY: one parameter, `struct symm_rmsnorm_params` by value.
    unsafe {
        kernels.launch(&kernels.add_rmsnorm[dtype as usize], blocks, (AR_THREADS, 1, 1), stream, &mut params, "rmsnorm")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AllReduceNorm;
    use std::time::Duration;

    #[test]
    fn params_mirror_the_kernel_s_struct() {
        assert_eq!(std::mem::size_of::<ArParams>(), 16 * 8 + 16 * 8 + 8 * 4);
        assert_eq!(std::mem::size_of::<NormParams>(), 10 * 8 + 2 * 4);
    }

    fn call(algorithm: AllReduceAlgorithm, n: usize) -> AllReduceCall {
        let bytes = AllReduceLayout::bytes_for(n * 2, 2);
        AllReduceCall {
            algorithm,
            rank: 1,
            world: 2,
            dtype: DType::BF16,
            n,
            input: 0x1000,
            output: 0x2000,
            scale: 1.0,
            divisor: 1,
            scratch: vec![0x10_0000, 0x20_0000],
            scratch_bytes: bytes,
            norm: None,
            timeout: Duration::from_secs(1),
            tag: CallTag::of(b"test"),
        }
    }

    #[test]
    fn cuts_and_checks() {
        let grid = |c: &AllReduceCall, sms| {
            let cut = cut(c, sms);
            (cut.blocks, cut.segments)
        };
        assert_eq!(grid(&call(AllReduceAlgorithm::OneShot, 4096), 132), (2, 1)); // 8 KiB: 1024 lines
        assert_eq!(grid(&call(AllReduceAlgorithm::OneShot, 1 << 24), 132), (132, 1));
        assert_eq!(grid(&call(AllReduceAlgorithm::TwoShot, 1), 132), (1, 1));
        // 16 MiB: 128 chunk groups; 1 MiB: 8 KiB chunks, two per group.
        assert_eq!(grid(&call(AllReduceAlgorithm::TwoShot, 8 << 20), 132), (128, 1));
        assert_eq!(grid(&call(AllReduceAlgorithm::TwoShot, 1 << 19), 132), (64, 1));
        assert_eq!(grid(&call(AllReduceAlgorithm::TwoShot, 8 << 20), 100), (100, 1));
        let normed = |algorithm, rows: usize, hidden: usize| {
            let mut c = call(algorithm, rows * hidden);
            c.norm = Some(AllReduceNorm { hidden, residual: 0x3000, weight: 0x4000, residual_out: 0x3000, eps: 1e-6 });
            cut(&c, 132)
        };
        // The one-shot: rows split while they are fewer than the blocks of
        // one line per thread, at most 8 ways; whole rows otherwise.
        let split = |rows, hidden| {
            let c = normed(AllReduceAlgorithm::OneShot, rows, hidden);
            assert!(c.folds_norm);
            (c.blocks, c.segments)
        };
        assert_eq!(split(1, 4096), (2, 2));
        assert_eq!(split(16, 8192), (64, 4));
        assert_eq!(split(64, 8192), (128, 2));
        assert_eq!(split(2, 65536), (16, 8));
        assert_eq!(split(100, 8192), (132, 1));
        assert_eq!(split(300, 4096), (132, 1));
        assert!(!normed(AllReduceAlgorithm::OneShot, 3, 33).folds_norm); // rows not whole lines
                                                                         // The two-shot: its norm after it.
        let c = normed(AllReduceAlgorithm::TwoShot, 512, 8192);
        assert_eq!((c.blocks, c.chunk_bytes, c.folds_norm), (128, 32 << 10, false));
        let p = params(&call(AllReduceAlgorithm::TwoShot, 1000), 0).unwrap();
        assert_eq!((p.rank, p.world, p.scratch[1], p.scratch[2]), (1, 2, 0x20_0000, 0));
        let mut c = call(AllReduceAlgorithm::OneShot, 1000);
        c.scratch_bytes = 4096;
        assert!(params(&c, 0).is_err());
        let mut c = call(AllReduceAlgorithm::OneShot, 1000);
        c.output = 0x2001;
        assert!(params(&c, 0).is_err());
        let mut c = call(AllReduceAlgorithm::TwoShot, 1000);
        c.divisor = 0;
        assert!(params(&c, 0).is_err());
        c.divisor = 4;
        assert_eq!(params(&c, 0).unwrap().divisor, 4);
        let gather = AllGatherCall {
            algorithm: AllReduceAlgorithm::OneShot,
            rank: 1,
            world: 2,
            bytes: 1001,
            input: 0x1001,
            output: 0x2003,
            scratch: vec![0x10_0000, 0x20_0000],
            scratch_bytes: AllReduceLayout::bytes_for(1001, 2),
            timeout: Duration::from_secs(1),
            tag: CallTag::of(b"test"),
        };
        let p = gather_params(&gather, 0).unwrap();
        assert_eq!((p.n, p.input, p.output, p.rank, p.world), (1001, 0x1001, 0x2003, 1, 2));
        let layout = AllReduceLayout::of(gather.scratch_bytes, 2);
        assert_eq!((p.one_off, p.one_slot), (layout.one_shot as u64, layout.one_shot_slot as u64));
        assert!(gather_params(&AllGatherCall { scratch_bytes: 4096, ..gather.clone() }, 0).is_err());
        assert!(gather_params(&AllGatherCall { output: 0, ..gather.clone() }, 0).is_err());
        assert!(gather_params(&AllGatherCall { rank: 2, ..gather.clone() }, 0).is_err());
        // 128 KiB per rank: 16384 lines, 32 blocks of 512 threads.
        assert_eq!(gather_grid(128 << 10, 132), 32);
        // By pieces: 128 KiB in 32 of 4 KiB, 2 MiB and 64 MiB in 128.
        assert_eq!(pieces_grid(128 << 10, 132), 32);
        assert_eq!((pieces_grid(2 << 20, 132), pieces_grid(64 << 20, 132), pieces_grid(8, 132)), (128, 128, 1));
        assert_eq!((gather_grid(1, 132), gather_grid(64 << 20, 132)), (1, 132));
        // The reduce-scatter: chunks of whole lines, p.chunk_bytes their stride.
        let scatter = ReduceScatterCall {
            algorithm: AllReduceAlgorithm::OneShot,
            rank: 1,
            world: 2,
            dtype: DType::BF16,
            n: 1000,
            input: 0x1000,
            chunk_stride: 2048,
            output: 0x3002,
            scale: 0.5,
            scratch: vec![0x10_0000, 0x20_0000],
            scratch_bytes: AllReduceLayout::bytes_for(2000, 2),
            timeout: Duration::from_secs(1),
            tag: CallTag::of(b"test"),
        };
        let p = scatter_params(&scatter, 0).unwrap();
        assert_eq!((p.n, p.input, p.output, p.chunk_bytes, p.scale), (1000, 0x1000, 0x3002, 2048, 0.5));
        for bad in [
            ReduceScatterCall { n: 1001, ..scatter.clone() },
            ReduceScatterCall { chunk_stride: 1998, ..scatter.clone() },
            ReduceScatterCall { chunk_stride: 2004, ..scatter.clone() },
            ReduceScatterCall { input: 0x1004, ..scatter.clone() },
            ReduceScatterCall { dtype: DType::F8E4M3, n: 2000, ..scatter.clone() },
            ReduceScatterCall { dtype: DType::I32, ..scatter.clone() },
            ReduceScatterCall { scratch_bytes: 4096, ..scatter.clone() },
        ] {
            assert!(scatter_params(&bad, 0).is_err(), "{bad:?}");
        }
    }

    /// The LL kernels with two ranks on one GPU: one context, each rank's
    /// kernel on a stream of its own, messages small enough that both grids
    /// are resident at once (each spins for the other's lines). What a
    /// one-GPU machine can check of the one-shot and two-shot all-reduce,
    /// the all-gather and the reduce-scatter, in f32 and bf16, repeated
    /// (the buffers count the calls): against exact sums of small integers,
    /// outputs poisoned.
    #[test]
    fn gpu_lines_kernels_with_two_ranks_on_one_gpu() {
        use crate::backend::cuda::async_error::AsyncError;
        use crate::backend::cuda::gemm::GemmDtype;
        use crate::backend::cuda::gpu_testing::{decode, encode, gpu, gpu_on, DevBuf};
        use crate::backend::{AllGatherCall, ReduceScatterCall};
        let Some(g0) = gpu() else { return };
        let gpus = [g0, gpu_on(0)]; // one stream per rank
        gpus[0].ctx.bind_to_thread().unwrap();
        let errors = AsyncError::new().unwrap();
        let (world, most) = (2, 64 << 10);
        let scratch_bytes = AllReduceLayout::bytes_for(most, world);
        let buffers: Vec<DevBuf> = (0..world).map(|_| gpus[0].upload(&vec![0u8; scratch_bytes])).collect();
        let scratch: Vec<u64> = buffers.iter().map(|b| b.ptr).collect();
        let value = |r: usize, i: usize, k: usize| ((r * 7 + i * 3 + k) % 17) as f32 - 8.0;
        let timeout = Duration::from_secs(10);
        // Rank r's all-reduce of n elements of `ins` into `outs`, through `scratch`.
        let all_reduce_call =
            |algorithm, r: usize, dtype, n, ins: &[DevBuf], outs: &[DevBuf], scratch: &[u64], tag| AllReduceCall {
                algorithm,
                rank: r,
                world,
                dtype,
                n,
                input: ins[r].ptr,
                output: outs[r].ptr,
                scale: 1.0,
                divisor: 1,
                scratch: scratch.to_vec(),
                scratch_bytes,
                norm: None,
                timeout,
                tag,
            };
        let run_both = |launch: &dyn Fn(usize) -> Result<()>| {
            (0..world).for_each(|r| launch(r).unwrap());
            gpus.iter().for_each(|g| g.sync());
            errors.check().unwrap();
        };
        for (dtype, gd) in [(DType::F32, GemmDtype::F32), (DType::BF16, GemmDtype::BF16)] {
            let size = dtype.size();
            for (k, n) in [(0, 1000), (1, 4096), (2, most / size / world)] {
                let inputs: Vec<Vec<f32>> =
                    (0..world).map(|r| (0..n * world).map(|i| value(r, i, k)).collect()).collect();
                let ins: Vec<DevBuf> = inputs.iter().map(|v| gpus[0].upload(&encode(gd, v))).collect();
                let outs: Vec<DevBuf> = (0..world).map(|_| gpus[0].upload(&vec![0xffu8; n * world * size])).collect();
                let read = |r: usize, len: usize| decode(gd, &outs[r].read_bytes()[..len * size]);
                let poison = || outs.iter().for_each(|o| o.write(&vec![0xffu8; n * world * size]));
                for algorithm in [AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot] {
                    poison();
                    run_both(&|r| {
                        let tag = CallTag::of(format!("{dtype} {n} {algorithm:?}").as_bytes());
                        let c = all_reduce_call(algorithm, r, dtype, n, &ins, &outs, &scratch, tag);
                        all_reduce(&gpus[r].kernels, &c, errors.device_ptr(), gpus[r].stream())
                    });
                    let want: Vec<f32> = (0..n).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
                    for r in 0..world {
                        assert_eq!(read(r, n), want, "{dtype} {n} {algorithm:?} rank {r}");
                    }
                }
                // The all-gather by each kernel: LL lines, and pieces.
                for algorithm in [AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot] {
                    poison();
                    run_both(&|r| {
                        let c = AllGatherCall {
                            algorithm,
                            rank: r,
                            world,
                            bytes: n * size,
                            input: ins[r].ptr,
                            output: outs[r].ptr,
                            scratch: scratch.clone(),
                            scratch_bytes,
                            timeout,
                            tag: CallTag::of(format!("{dtype} {n} {algorithm:?} all-gather").as_bytes()),
                        };
                        all_gather(&gpus[r].kernels, &c, errors.device_ptr(), gpus[r].stream())
                    });
                    let want: Vec<f32> = (0..world).flat_map(|q| inputs[q][..n].to_vec()).collect();
                    for r in 0..world {
                        assert_eq!(read(r, n * world), want, "{dtype} {n} {algorithm:?} all-gather rank {r}");
                    }
                }
                for algorithm in [AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot] {
                    poison();
                    run_both(&|r| {
                        let c = ReduceScatterCall {
                            algorithm,
                            rank: r,
                            world,
                            dtype,
                            n,
                            input: ins[r].ptr,
                            chunk_stride: n * size,
                            output: outs[r].ptr,
                            scale: 1.0,
                            scratch: scratch.clone(),
                            scratch_bytes,
                            timeout,
                            tag: CallTag::of(format!("{dtype} {n} reduce-scatter {algorithm:?}").as_bytes()),
                        };
                        reduce_scatter(&gpus[r].kernels, &c, errors.device_ptr(), gpus[r].stream())
                    });
                    for r in 0..world {
                        let want: Vec<f32> = (0..n).map(|i| inputs.iter().map(|v| v[r * n + i]).sum()).collect();
                        assert_eq!(read(r, n), want, "{dtype} {n} reduce-scatter {algorithm:?} rank {r}");
                    }
                }
            }
        }
        // Ranks out of step, each on fresh buffers and error record: rank 1
        // makes another call of the same kernel and size, or another kernel
        // (whose lines and flags are not the two-shot's). Both end in a
        // Mismatch, found in the peers' tag words.
        let n = 4096;
        let ins: Vec<DevBuf> =
            (0..world).map(|r| gpus[0].upload(&encode(GemmDtype::F32, &vec![r as f32; n]))).collect();
        let outs: Vec<DevBuf> = (0..world).map(|_| gpus[0].upload(&vec![0xffu8; n * world * 4])).collect();
        for other_kernel in [false, true] {
            let errors = AsyncError::new().unwrap();
            let buffers: Vec<DevBuf> = (0..world).map(|_| gpus[0].upload(&vec![0u8; scratch_bytes])).collect();
            let scratch: Vec<u64> = buffers.iter().map(|b| b.ptr).collect();
            for r in 0..world {
                // The same kernel's lines, from the other call; the
                // two-shot's flags, which the all-gather never sets.
                let algorithm = if other_kernel { AllReduceAlgorithm::TwoShot } else { AllReduceAlgorithm::OneShot };
                let tag = CallTag::of(if r == 0 { b"call x".as_slice() } else { b"call y".as_slice() });
                let c = all_reduce_call(algorithm, r, DType::F32, n, &ins, &outs, &scratch, tag);
                if r == 1 && other_kernel {
                    let g = AllGatherCall {
                        algorithm: AllReduceAlgorithm::OneShot,
                        rank: r,
                        world,
                        bytes: n * 4,
                        input: ins[r].ptr,
                        output: outs[r].ptr,
                        scratch: scratch.clone(),
                        scratch_bytes,
                        timeout,
                        tag: c.tag,
                    };
                    all_gather(&gpus[r].kernels, &g, errors.device_ptr(), gpus[r].stream()).unwrap();
                } else {
                    all_reduce(&gpus[r].kernels, &c, errors.device_ptr(), gpus[r].stream()).unwrap();
                }
            }
            gpus.iter().for_each(|g| g.sync());
            let e = errors.check().unwrap_err();
            // (Only the first failure is recorded: a timeout would have
            // been the first.)
            assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "other kernel {other_kernel}: {}", e.msg);
        }
    }
}
