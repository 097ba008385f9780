//! Host side of `kernels/gemm_sm90.cu`: symm's own persistent Hopper matmul,
//! whose tiles can wait for all-gathered rows or push reduce-scatter
//! partials (see the kernel's header comment for the design).
//!
//! Available only on compute capability 9.0 devices whose loaded module
//! holds the sm_90a code (checked once by launching a probe kernel), with
//! the driver's tensor-map encoder. Operands: A row-major `[m, k]`, B
//! K-major (stored `[n, k]`, a Linear weight), C row-major `[m, n]`; A and B
//! bf16 or f16 (C f32 or the input type), or fp8 with scales and an
//! optional bias as `torch._scaled_mm` (C f32, bf16 or f16); base addresses
//! and row strides 16-byte aligned (TMA's rules). [`Sm90Matmul::check`]
//! says why a problem does not qualify, and callers then use cuBLASLt.

use super::compute::gemm_dtype;
use super::driver::{self, check};
use super::gemm::{Fp8, Fp8Params, GemmDtype};
use crate::array::Array;
use crate::backend::{FusedMatmul, Stream};
use crate::error::{err, Result};
use cudarc::driver::{sys, CudaFunction, CudaModule};
use std::ffi::c_void;
use std::sync::Arc;

/// Most row chunks (ranks) a fused call may have (`SYMM_GEMM_MAX_CHUNKS`).
pub const MAX_CHUNKS: usize = 16;
/// Rows of a tile (`SYMM_GEMM_BM`).
pub const BM: usize = 128;
/// Row tiles walked together, column by column (`SYMM_GEMM_GROUP_M`).
const GROUP_M: usize = 8;
/// Bytes of each row of A and B in a k-block (`SYMM_GEMM_BK_BYTES`).
const BK_BYTES: usize = 128;
const THREADS: u32 = 384;
/// Shared memory staging C for TMA stores (`SYMM_GEMM_EPI_BYTES`).
const EPI_BYTES: usize = 2 * 16384;
/// The SM count that decisions made from the shape alone assume (tile
/// width, narrow peer tiles): every rank must number tiles, and their flags,
/// alike whatever its device, so none of them reads its own SM count.
const SHAPE_SMS: usize = 132;
/// Rows of C's TMA box (each consumer warpgroup stores 64 rows); its
/// columns span 128 bytes, the swizzle's width.
const C_BOX_ROWS: usize = 64;

/// Driver entry points beyond the backend's base set.
pub(super) const SYMBOLS: &[&str] = &["cuTensorMapEncodeTiled", "cuFuncSetAttribute"];

/// Mirror of `struct symm_gemm_params`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Params {
    m: i32,
    n: i32,
    k: i32,
    out_dtype: i32,
    c: u64,
    ldc: i64,
    chunks: i32,
    chunk_rows: i32,
    order: [i32; MAX_CHUNKS],
    local_chunk: i32,
    rs: i32,
    ready: u64,
    rank: i32,
    world: i32,
    inbox: [u64; MAX_CHUNKS],
    rs_state: [u64; MAX_CHUNKS],
    alpha: f32,
    c_tma: i32,
    timeout_ns: u64,
    err: u64,
    a_scale: u64,
    b_scale: u64,
    bias: u64,
    a_scale_slot: i64,
    scale_mode: i32,
    rs_push: i32,
    slices: i32,
    slice_kblocks: i32,
    trace: u64,
    rs_narrow_n: i32,
    rs_narrow_w: i32,
    rs_c_store: i32,
    rs_push_ring: i32,
    rs_narrow_less: i32,
    cut_n: i32,
    cut_w: i32,
}

const _: () = assert!(std::mem::size_of::<Params>() == 496);
// A gathered slice is whole k-blocks of every input type.
const _: () = assert!(Sm90Matmul::SLICE_ALIGN % BK_BYTES == 0);

/// `SYMM_RS_C_*`: how a fused reduce-scatter's own rows reach C.
const RS_C_REGISTERS: i32 = 0;
const RS_C_STAGED: i32 = 1;
const RS_C_RING: i32 = 2;
const RS_C_ADD: i32 = 3;

/// `SYMM_GEMM_SCALES_*`.
const SCALES_NONE: i32 = 0;
const SCALES_TENSOR: i32 = 1;
const SCALES_ROW: i32 = 2;

/// A `CUtensorMap` (128 bytes, 64-byte aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TensorMap([u64; 16]);

/// Mirror of `struct symm_rs_maps`: the reduce-scatter's TMA maps (rs_push).
#[repr(C)]
#[derive(Clone, Copy)]
struct RsMaps {
    /// This rank's inbox, `[world][chunk_rows][n]`, boxes of 128 rows of one slot.
    inbox: TensorMap,
    /// `push[d]`: rank d's inbox slot for this rank, `[chunk_rows][n]`.
    push: [TensorMap; MAX_CHUNKS],
}

/// Tile widths the kernels come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileN {
    N128,
    N256,
}

impl TileN {
    pub const fn cols(self) -> usize {
        match self {
            TileN::N128 => 128,
            TileN::N256 => 256,
        }
    }

    const fn stages(self) -> usize {
        match self {
            TileN::N128 => 6,
            TileN::N256 => 4,
        }
    }

    /// Dynamic shared memory of the kernel (`symm_gemm_cfg::SMEM_BYTES`):
    /// the ring, the epilogue's staging (`SYMM_GEMM_EPI_BYTES`), barriers
    /// (the ring's two per stage, the two of the reduce-scatter's flag
    /// handoff), the reduce-scatter's epoch (8 bytes) and its peers-ready
    /// barrier.
    const fn smem_bytes(self) -> usize {
        let stage = (BM + self.cols()) * BK_BYTES;
        self.stages() * stage + EPI_BYTES + (2 * self.stages() + 4) * 8 + 1024
    }
}

/// The input types the kernels come in, as named in their entry points
/// (`symm_gemm_sm90_<name>_n<cols>`); the fp8 ones (the last three) also
/// as `..._n128_exact`, which promote partial sums into f32 registers.
const INPUTS: [&str; 5] = ["bf16", "f16", "e4m3_e4m3", "e4m3_e5m2", "e5m2_e4m3"];

/// The loaded kernels of one device: `[INPUTS][N128, N256]`, and the
/// exact fp8 ones.
pub struct Sm90Kernels {
    functions: Vec<[CudaFunction; 2]>,
    exact: Vec<CudaFunction>,
}

impl Sm90Kernels {
    /// The kernels when `module` can run them on this device, else `None`
    /// (another architecture, a driver without the tensor-map encoder, or a
    /// module the driver loaded from non-sm_90a code).
    pub fn load(module: &Arc<CudaModule>, ordinal: i32) -> Result<Option<Self>> {
        use sys::CUdevice_attribute::*;
        let major = driver::attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = driver::attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        if (major, minor) != (9, 0) || !driver_has_symbols() {
            return Ok(None);
        }
        let f =
            |name: &str| module.load_function(name).map_err(|e| driver::cuda_err(e, &format!("loading kernel {name}")));
        if !probe(&f("symm_gemm_sm90_probe")?)? {
            return Ok(None);
        }
        let functions = INPUTS
            .iter()
            .map(|i| Ok([f(&format!("symm_gemm_sm90_{i}_n128"))?, f(&format!("symm_gemm_sm90_{i}_n256"))?]))
            .collect::<Result<Vec<_>>>()?;
        let exact =
            INPUTS[2..].iter().map(|i| f(&format!("symm_gemm_sm90_{i}_n128_exact"))).collect::<Result<Vec<_>>>()?;
        let sized = functions
            .iter()
            .flat_map(|[n128, n256]| [(n128, TileN::N128), (n256, TileN::N256)])
            .chain(exact.iter().map(|f| (f, TileN::N128)));
        for (function, tile) in sized {
            let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            // SAFETY: a loaded function; symbols checked.
            check(
                unsafe { sys::cuFuncSetAttribute(function.cu_function(), attr, tile.smem_bytes() as i32) },
                "cuFuncSetAttribute",
            )?;
        }
        Ok(Some(Sm90Kernels { functions, exact }))
    }

    /// The kernel for `mm`'s input types, accumulation and tile (checked).
    fn function(&self, mm: &Sm90Matmul) -> &CudaFunction {
        let row = match mm.fp8 {
            None if mm.dtype == GemmDtype::F16 => 1,
            None => 0,
            Some(f) => match (f.a_type, f.b_type) {
                (Fp8::E4M3, Fp8::E4M3) => 2,
                (Fp8::E4M3, Fp8::E5M2) => 3,
                _ => 4,
            },
        };
        match mm.fp8 {
            Some(f) if !f.fast_accum => &self.exact[row - 2],
            _ => &self.functions[row][mm.tile as usize],
        }
    }
}

fn driver_has_symbols() -> bool {
    // SAFETY: the driver was checked present by the backend before any module loads.
    let lib = unsafe { sys::culib() };
    // SAFETY (in the closure): looking a symbol up has no side effects.
    driver::missing_symbols(SYMBOLS, |n| unsafe { lib.get::<unsafe extern "C" fn()>(n) }.is_ok()).is_empty()
}

/// Runs `symm_gemm_sm90_probe` on a private stream: true when the driver
/// loaded the sm_90a code. Writes into mapped host memory and synchronizes
/// only that stream, so ranks sharing the device are never waited for.
fn probe(f: &CudaFunction) -> Result<bool> {
    let mut host = std::ptr::null_mut();
    // SAFETY: out-pointer valid; flags are driver constants.
    check(unsafe { sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }, "cuMemHostAlloc")?;
    let result = (|| {
        // SAFETY: 4 bytes just allocated.
        unsafe { (host as *mut i32).write_volatile(-1) };
        let mut dev = 0u64;
        // SAFETY: mapped host memory.
        check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }, "cuMemHostGetDevicePointer")?;
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: out-pointer valid.
        check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "cuStreamCreate")?;
        let mut params = [(&mut dev as *mut u64).cast::<c_void>()];
        // SAFETY: the probe takes one pointer; `dev` outlives the launch.
        let launched = check(
            unsafe {
                sys::cuLaunchKernel(
                    f.cu_function(),
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "launching symm_gemm_sm90_probe",
        )
        .and_then(|()| check(unsafe { sys::cuStreamSynchronize(stream) }, "cuStreamSynchronize"));
        // SAFETY: created above.
        unsafe { sys::cuStreamDestroy_v2(stream) };
        launched?;
        // SAFETY: the stream finished; the kernel wrote 0 or 1.
        Ok(unsafe { (host as *const i32).read_volatile() } == 1)
    })();
    // SAFETY: allocated above, no longer used by the device.
    unsafe { sys::cuMemFreeHost(host) };
    result
}

/// A row-major (2-D) operand as stored: `rows x cols` elements, `ld`
/// elements between rows.
#[derive(Clone, Copy, Debug)]
pub struct Operand {
    pub ptr: u64,
    pub rows: usize,
    pub ld: usize,
}

/// How the fused all-gather feeds the matmul: A's rows arrive chunk by
/// chunk, each in slices of `slice_k` columns, slice s of chunk c
/// announced by a nonzero u32 at `ready + 4 * (c * slices + s)` with
/// `slices = k / slice_k` (see [`Sm90Matmul::slices`]; one slice when
/// `slice_k >= k`). With several slices A is slice-major,
/// `[slices][a.rows][slice_k]` with `a.ld == slice_k`, so that a chunk's
/// slice is contiguous; `slice_k` then divides k and is a multiple of
/// [`Sm90Matmul::SLICE_ALIGN`]. This rank's own chunk is read in place
/// from `local` (row-major). With row-wise fp8
/// scales, `a_scale` is the gathered scales: chunk c's at element
/// `c * scale_slot` (written before chunk c's flag, this rank's own before
/// the launch).
#[derive(Clone, Copy, Debug)]
pub struct Gather {
    pub ready: u64,
    /// Columns of k per slice (see above).
    pub slice_k: usize,
    pub local_chunk: usize,
    pub local: Operand,
    pub scale_slot: usize,
}

/// The fused reduce-scatter epilogue: chunk `d` of the product's rows is
/// rank `d`'s output. `inbox[d]` / `state[d]` are rank `d`'s inbox and
/// reduce-scatter state (`symm_rs_state`, then its tile flags) as mapped
/// here (sizes from [`Sm90Matmul::inbox_bytes`] and
/// [`Sm90Matmul::state_bytes`]); C is this rank's output chunk. The state
/// must start zeroed and then belong to these calls alone: it carries the
/// count of calls that lets one follow another without a barrier.
///
/// `out[d]`, where set, is rank `d`'s C as mapped here (every rank's at the
/// same offset of a symmetric buffer): see [`Sm90Matmul::rs_adds`].
#[derive(Clone, Debug)]
pub struct Scatter {
    pub rank: usize,
    pub inbox: Vec<u64>,
    pub state: Vec<u64>,
    pub out: Option<Vec<u64>>,
}

/// One launch: `C[m, n] = alpha * A[m, k] @ B[n, k]^T`, A's rows in
/// `chunks` equal chunks of `chunk_rows` visited in `order`.
#[derive(Clone, Debug)]
pub struct Sm90Matmul {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
    pub c: Operand,
    /// Type of A and B (unless `fp8` is set).
    pub dtype: GemmDtype,
    /// Type of C: `dtype` or F32; with `fp8`, any.
    pub out_dtype: GemmDtype,
    /// fp8 A and B, their scales and bias: `C = alpha * (sa * sb * A @ B^T + bias)`
    /// (set with [`Sm90Matmul::set_fp8`]).
    pub fp8: Option<Fp8Params>,
    pub alpha: f32,
    pub chunk_rows: usize,
    pub order: Vec<usize>,
    pub gather: Option<Gather>,
    pub scatter: Option<Scatter>,
    pub tile: TileN,
    /// CTAs to launch at most (default: one per SM); fewer leave SMs free.
    pub max_ctas: Option<u32>,
    /// Store C through shared memory and TMA where it qualifies (default);
    /// false: straight from registers (for comparisons).
    pub tma_epilogue: bool,
    /// Reduce-scatter: peers' tiles out by TMA stores and their partials
    /// in through the ring where TMA can address the rows (default);
    /// false: stores, flags and adds from registers.
    pub rs_push: bool,
    pub timeout_ns: u64,
    /// Device pointer of the group's `symm_async_error` record.
    pub err: u64,
    /// 0, or where each CTA records its timestamps (`super::sm90_trace`).
    pub trace: u64,
    /// Reduce-scatter: the peers' chunks in narrower tiles on the SMs a
    /// wave of 256-wide tiles leaves idle (see [`narrow_peers`]); used
    /// with rs_push only.
    pub rs_narrow: Option<NarrowPeers>,
    /// Reduce-scatter with rs_push: this rank's own rows go to C from the
    /// ring where the peers' partials were added (default, unless
    /// `SYMM_RS_IN_RING=0`; false: through the staging area, for
    /// comparisons), where C is TMA-addressable, else from registers.
    pub rs_in_ring: bool,
    /// Narrow peer tiles, 16-bit C: a CTA's last one stages all its boxes
    /// at once in the ring, free after its k-loop (default, unless
    /// `SYMM_RS_PUSH_RING=0`; false: two at a time through the staging
    /// area, each pair once the previous one's stores have read it).
    pub rs_push_ring: bool,
    /// Narrow peer tiles at world 2 with every rank's C in symmetric
    /// memory: the peer's partials go straight into C (default, unless
    /// `SYMM_RS_ADD_C=0`, set alike on every rank; see `rs_adds`).
    pub rs_add_c: bool,
    /// A plain or gathered matmul: its columns cut into tiles that fill
    /// the grid's waves where that shortens the busiest CTA's share
    /// (default, unless `SYMM_SM90_CUT=0`; see [`Sm90Matmul::column_cut`]).
    pub column_cut: bool,
}

/// The peers' chunks of a one-wave reduce-scatter cut into `tiles` tiles
/// per 128-row tile, `width` columns wide (the first few 8 wider, to cover
/// n, and as many more as the last `narrower`, which are 8 narrower), so
/// that they finish before this rank's own 256-wide tiles and their pushes
/// cross NVLink while those still multiply ("Narrow peer tiles" in the
/// kernel's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NarrowPeers {
    pub tiles: usize,
    pub width: usize,
    pub narrower: usize,
}

impl NarrowPeers {
    /// Widths the kernels have a k-loop for.
    const WIDTHS: [usize; 3] = [232, 240, 248];

    /// Tiles of `width + 8` columns (the first ones) to cover `n`.
    fn wider(self, n: usize) -> Option<usize> {
        (n.div_ceil(8) + self.narrower)
            .checked_sub(self.tiles * (self.width / 8))
            .filter(|&e| e + self.narrower <= self.tiles && e < self.tiles)
    }

    /// Whether these tiles cover `n` columns in widths the kernels have.
    fn covers(self, n: usize) -> bool {
        let has = |w: usize| Self::WIDTHS.contains(&w);
        self.wider(n).is_some_and(|e| {
            has(self.width) && (e == 0 || has(self.width + 8)) && (self.narrower == 0 || has(self.width - 8))
        })
    }
}

impl Sm90Matmul {
    /// A plain matmul of `a.rows x k` by `b.rows x k` (one chunk), the tile
    /// width chosen for the shape.
    pub fn plain(a: Operand, b: Operand, c: Operand, k: usize, dtype: GemmDtype, err: u64) -> Self {
        let (m, n) = (a.rows, b.rows);
        Sm90Matmul {
            m,
            n,
            k,
            a,
            b,
            c,
            dtype,
            out_dtype: dtype,
            fp8: None,
            alpha: 1.0,
            chunk_rows: m,
            order: vec![0],
            gather: None,
            scatter: None,
            tile: choose_tile(m, n, 1, SHAPE_SMS),
            max_ctas: None,
            tma_epilogue: true,
            rs_push: true,
            timeout_ns: 0,
            trace: 0,
            rs_narrow: None,
            rs_in_ring: knob_on("SYMM_RS_IN_RING"),
            rs_push_ring: knob_on("SYMM_RS_PUSH_RING"),
            rs_add_c: knob_on("SYMM_RS_ADD_C"),
            column_cut: knob_on("SYMM_SM90_CUT"),
            err,
        }
    }

    /// The launch for a backend-neutral fused call; `err` is the device
    /// pointer of the group's error record. The tile width depends on the
    /// shape only (never on this device's SM count), so that every rank
    /// numbers the tiles, and their flags, alike.
    pub fn from_fused(call: &FusedMatmul, err: u64) -> Result<Self> {
        let no = |why: String| err!(Unsupported, "symm's sm90 matmul: {why}");
        let row_major = |t: &Array, name: &str| -> Result<Operand> {
            match (t.shape.as_slice(), t.strides.as_slice()) {
                ([rows, _], [ld, 1]) => Ok(Operand { ptr: t.addr, rows: *rows, ld: (*ld).max(1) }),
                _ => Err(no(format!("{name} must be a row-major matrix (strides {:?})", t.strides))),
            }
        };
        let a = row_major(&call.a, "A")?;
        // B [k, n] stored K-major is the row-major [n, k] matrix.
        let b = match (call.b.shape.as_slice(), call.b.strides.as_slice()) {
            ([_, n], [1, ld]) => Operand { ptr: call.b.addr, rows: *n, ld: (*ld).max(1) },
            _ => {
                return Err(no(format!(
                    "B must be K-major (a Linear weight's transpose), strides {:?}",
                    call.b.strides
                )))
            }
        };
        let c = row_major(&call.c, "C")?;
        let (k, n) = (call.a.shape[1], call.b.shape[1]);
        let chunks = call.order.len();
        let fp8 = match (call.a.dtype.fp8(), call.b.dtype.fp8(), &call.scales) {
            (None, None, None) => None,
            (Some(a_type), Some(b_type), Some(s)) => Some(Fp8Params {
                a_type,
                b_type,
                row_wise: s.row_wise,
                a_scale: s.a.addr,
                b_scale: s.b.addr,
                bias: s.bias.as_ref().map_or(0, |t| t.addr),
                // As the pipelined path (cuBLASLt) and torch by default.
                fast_accum: false,
            }),
            _ => return Err(no("fp8 needs A and B of fp8 types and scales; other types take none".into())),
        };
        // With fp8 the 16-bit input type is unused (as in MatmulParams).
        let dtype = if fp8.is_some() { GemmDtype::BF16 } else { gemm_dtype(call.a.dtype)? };
        let mut mm = Sm90Matmul::plain(a, b, c, k, dtype, err);
        mm.out_dtype = gemm_dtype(call.c.dtype)?;
        mm.alpha = call.alpha;
        mm.chunk_rows = call.chunk_rows;
        mm.order = call.order.clone();
        mm.tile = fused_tile(call.chunk_rows, n, chunks);
        if let Some(f) = fp8 {
            mm.set_fp8(f);
        }
        mm.timeout_ns = call.timeout.as_nanos().min(u64::MAX as u128) as u64;
        if let Some(g) = &call.gather {
            if g.slice_k < k {
                // Slice-major (see FusedGather): rows of one slice.
                if mm.a.ld != k {
                    return Err(no("a gathered A in slices must be a contiguous array".into()));
                }
                mm.a.ld = g.slice_k;
            }
            mm.gather = Some(Gather {
                ready: g.ready,
                slice_k: g.slice_k,
                local_chunk: g.local_chunk,
                local: row_major(&g.local, "the local shard")?,
                scale_slot: g.scale_slot,
            });
        }
        if let Some(s) = &call.scatter {
            mm.scatter =
                Some(Scatter { rank: s.rank, inbox: s.inbox.clone(), state: s.state.clone(), out: s.out.clone() });
            if mm.fp8.is_none() {
                mm.rs_narrow = narrow_plan(call.chunk_rows, n, chunks);
            }
        }
        Ok(mm)
    }

    /// Makes this an fp8 matmul; exact accumulation (not `fast_accum`)
    /// needs the 128-wide tile (see the kernel's header).
    pub fn set_fp8(&mut self, f: Fp8Params) {
        self.fp8 = Some(f);
        if !f.fast_accum {
            self.tile = TileN::N128;
        }
    }

    pub fn chunks(&self) -> usize {
        self.order.len()
    }

    /// A gathered slice's width divides into whole k-blocks of every
    /// input type (64 16-bit or 128 8-bit elements).
    pub const SLICE_ALIGN: usize = crate::backend::FusedGather::SLICE_ALIGN;

    /// The all-gather's slices per chunk (1 without a gather).
    pub fn slices(&self) -> usize {
        self.gather.as_ref().map_or(1, |g| self.k.div_ceil(g.slice_k.max(1)))
    }

    /// k-blocks per slice of the all-gather (all of them in one slice).
    fn slice_kblocks(&self) -> usize {
        let bk = BK_BYTES / self.in_size();
        match &self.gather {
            Some(g) if self.slices() > 1 => g.slice_k / bk,
            _ => self.k.div_ceil(bk),
        }
    }

    /// Tiles in one chunk, the peers' narrow ones if narrower (the rs
    /// flags per source rank).
    pub fn tiles_per_chunk(&self) -> usize {
        let across = self.narrow().map_or(0, |w| w.tiles).max(self.n.div_ceil(self.tile.cols()));
        self.chunk_rows.div_ceil(BM) * across
    }

    /// The narrow peer tiles this launch uses: where set, and the
    /// reduce-scatter goes through TMA (decided alike on every rank).
    pub fn narrow(&self) -> Option<NarrowPeers> {
        self.rs_narrow.filter(|_| self.rs_pushes() && self.fp8.is_none() && self.tile == TileN::N256)
    }

    /// Tiles of the whole launch with the column cut `cut`.
    fn tiles_with(&self, cut: Option<NarrowPeers>) -> usize {
        let tiles_m = self.chunk_rows.div_ceil(BM);
        let own = tiles_m * self.n.div_ceil(self.tile.cols());
        match (self.narrow(), cut) {
            (Some(w), _) => own + (self.chunks() - 1) * tiles_m * w.tiles,
            (None, Some(cut)) => tiles_m * cut.tiles * self.chunks(),
            (None, None) => own * self.chunks(),
        }
    }

    /// The column cut of a plain or gathered 16-bit matmul of 256-wide
    /// tiles on at most `ctas` CTAs ("Column cut" in the kernel's header):
    /// the one [`column_cut`] finds for its row tiles, where C is stored
    /// by TMA (a cut tile's store is a narrow tile's). Not for a
    /// reduce-scatter, whose ranks must number their tiles alike; a
    /// gathered matmul's flags are per chunk, so its cut may follow this
    /// device's SM count.
    pub fn column_cut(&self, ctas: u32) -> Option<NarrowPeers> {
        let eligible = self.column_cut
            && self.scatter.is_none()
            && self.fp8.is_none()
            && matches!(self.dtype, GemmDtype::BF16 | GemmDtype::F16)
            && self.tile == TileN::N256
            && self.c_through_tma();
        let rows = self.chunk_rows.div_ceil(BM) * self.chunks();
        eligible.then(|| column_cut(rows, self.n, ctas as usize)).flatten()
    }

    /// Bytes of one rank's rs inbox: a slot of `chunk_rows x n` per rank.
    pub fn inbox_bytes(&self) -> usize {
        self.chunks() * self.chunk_rows * self.n * self.out_dtype.size()
    }

    /// Bytes of one rank's rs state: `symm_rs_state`, then the tile flags,
    /// `tiles_per_chunk` u32 per rank.
    pub fn state_bytes(&self) -> usize {
        FusedMatmul::STATE_HEADER_BYTES + self.chunks() * self.tiles_per_chunk() * 4
    }

    /// `Err(Unsupported)` naming the first reason the kernel cannot run
    /// this problem.
    pub fn check(&self) -> Result<()> {
        let el = self.in_size();
        let no = |why: String| Err(err!(Unsupported, "symm's sm90 matmul: {why}"));
        match &self.fp8 {
            None if !matches!(self.dtype, GemmDtype::BF16 | GemmDtype::F16) => {
                return no(format!("inputs must be bf16, f16 or fp8, not {:?}", self.dtype));
            }
            None if self.out_dtype != self.dtype && self.out_dtype != GemmDtype::F32 => {
                return no(format!("output must be {:?} or f32, not {:?}", self.dtype, self.out_dtype));
            }
            None => {}
            Some(f) => {
                if (f.a_type, f.b_type) == (Fp8::E5M2, Fp8::E5M2) {
                    return no("A and B cannot both be e5m2".into());
                }
                if f.a_scale == 0 || f.b_scale == 0 || f.a_scale % 4 != 0 || f.b_scale % 4 != 0 {
                    return no("fp8 needs 4-byte aligned a_scale and b_scale".into());
                }
                if f.bias % self.out_dtype.size() as u64 != 0 {
                    return no("the bias is misaligned".into());
                }
                if !f.fast_accum && self.tile != TileN::N128 {
                    return no("fp8 with exact accumulation (not fast_accum) needs the 128-wide tile".into());
                }
            }
        }
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return no("empty problem".into());
        }
        if self.m > i32::MAX as usize || self.n > i32::MAX as usize || self.k > i32::MAX as usize {
            return no("dimensions past 2^31".into());
        }
        let chunks = self.chunks();
        if chunks == 0 || chunks > MAX_CHUNKS || self.chunk_rows == 0 || self.chunk_rows * chunks < self.m {
            return no(format!("{chunks} chunks of {} rows do not cover {} rows", self.chunk_rows, self.m));
        }
        let mut seen = [false; MAX_CHUNKS];
        for &c in &self.order {
            if c >= chunks || std::mem::replace(&mut seen[c], true) {
                return no(format!("order {:?} is not a permutation", self.order));
            }
        }
        let tma_ok = |o: &Operand| o.ptr % 16 == 0 && (o.ld * el) % 16 == 0 && o.ld >= self.k;
        // A slice-major gathered A has rows of one slice (checked below).
        let a_ok = if self.slices() > 1 { self.a.ptr % 16 == 0 } else { tma_ok(&self.a) };
        if !a_ok || !tma_ok(&self.b) {
            return no(format!("A and B need 16-byte aligned addresses and row strides (k a multiple of {})", 16 / el));
        }
        if let Some(g) = &self.gather {
            if !tma_ok(&g.local) || g.local_chunk >= chunks || g.ready == 0 || g.ready % 4 != 0 {
                return no("the gathered chunk's operand or flags are misaligned".into());
            }
            if g.slice_k == 0 {
                return no("a gathered slice of 0 columns".into());
            }
            let sliced = g.slice_k < self.k;
            if sliced && (g.slice_k % Self::SLICE_ALIGN != 0 || self.k % g.slice_k != 0 || self.a.ld != g.slice_k) {
                return no(format!(
                    "gathered slices of {} columns must be a multiple of {} dividing k = {}, A's rows one slice \
                     (ld {})",
                    g.slice_k,
                    Self::SLICE_ALIGN,
                    self.k,
                    self.a.ld
                ));
            }
        }
        if let Some(s) = &self.scatter {
            if s.rank >= chunks || s.inbox.len() != chunks || s.state.len() != chunks {
                return no("reduce-scatter needs one inbox and state per rank".into());
            }
            if self.order.last() != Some(&s.rank) {
                return no("reduce-scatter must visit this rank's own chunk last".into());
            }
        }
        if self.c.ld < self.n {
            return no("C's row stride is shorter than n".into());
        }
        if let Some(w) = self.rs_narrow {
            if !w.covers(self.n) {
                return no(format!("{} narrow peer tiles of {} columns do not cover n = {}", w.tiles, w.width, self.n));
            }
        }
        Ok(())
    }

    /// Bytes per element of A and B.
    fn in_size(&self) -> usize {
        if self.fp8.is_some() {
            1
        } else {
            self.dtype.size()
        }
    }

    /// CTAs launched on a device of `sm_count` SMs: one per tile, at most
    /// one per SM (persistent) or `max_ctas`.
    pub fn grid(&self, sm_count: u32) -> u32 {
        self.layout(sm_count).0
    }

    /// The grid and the column cut of a launch on `sm_count` SMs, the cut
    /// chosen once.
    fn layout(&self, sm_count: u32) -> (u32, Option<NarrowPeers>) {
        let ctas = self.max_ctas(sm_count);
        let cut = self.column_cut(ctas);
        ((self.tiles_with(cut) as u32).min(ctas), cut)
    }

    /// CTAs the launch may use: one per SM, or `max_ctas`.
    fn max_ctas(&self, sm_count: u32) -> u32 {
        sm_count.min(self.max_ctas.unwrap_or(u32::MAX)).max(1)
    }

    /// Enqueues the matmul on `stream`. `sm_count` is the device's.
    pub fn launch(&self, kernels: &Sm90Kernels, sm_count: u32, stream: Stream) -> Result<()> {
        self.check()?;
        let input = if self.fp8.is_some() { MapType::Byte } else { MapType::Elem(self.dtype) };
        let tm_a = match &self.gather {
            // Slice-major: [slices][m][slice_k].
            Some(g) if self.slices() > 1 => {
                let (el, a) = (input.size() as u64, &self.a);
                let dims = [g.slice_k as u64, a.rows as u64, self.slices() as u64];
                let strides = [g.slice_k as u64 * el, (a.rows * g.slice_k) as u64 * el];
                encode_tiled(input, a.ptr, &dims, &strides, &[(BK_BYTES / input.size()) as u32, BM as u32, 1])?
            }
            _ => encode(input, &self.a, self.k, BM)?,
        };
        let tm_a_local = match &self.gather {
            Some(g) => encode(input, &g.local, self.k, BM)?,
            None => tm_a,
        };
        let tm_b = encode(input, &self.b, self.k, self.tile.cols())?;
        let mut p = self.params();
        let (grid, cut) = self.layout(sm_count);
        if let Some(cut) = cut {
            (p.cut_n, p.cut_w) = (cut.tiles as i32, cut.width as i32);
        }
        let out = MapType::Elem(self.out_dtype);
        let c_box = BK_BYTES / self.out_dtype.size();
        // C through TMA stores where it can be (placeholder maps otherwise):
        // a plain C whole, or this rank's rows of a reduce-scatter.
        let mut rs = RsMaps { inbox: tm_a, push: [tm_a; MAX_CHUNKS] };
        let tm_c = if self.c_through_tma() {
            p.c_tma = 1;
            encode_box(out, &Operand { rows: self.m, ..self.c }, self.n, c_box, C_BOX_ROWS)?
        } else if let (Some(s), true) = (&self.scatter, self.rs_pushes()) {
            // Every rank pushes alike; only its own rows' store depends on
            // its C.
            p.rs_c_store = self.rs_c_store();
            let slot_bytes = (self.chunk_rows * self.n * self.out_dtype.size()) as u64;
            for (d, &inbox) in s.inbox.iter().enumerate().filter(|&(d, _)| d != s.rank) {
                // Into rank d's inbox slot for this rank, or added into its C.
                let ptr = match (&s.out, p.rs_c_store) {
                    (Some(outs), RS_C_ADD) => outs[d],
                    _ => inbox + s.rank as u64 * slot_bytes,
                };
                let dst = Operand { ptr, rows: self.chunk_rows, ld: self.n };
                rs.push[d] = encode_box(out, &dst, self.n, c_box, C_BOX_ROWS)?;
            }
            let dims = [self.n as u64, self.chunk_rows as u64, self.chunks() as u64];
            let strides = [(self.n * self.out_dtype.size()) as u64, slot_bytes];
            rs.inbox = encode_tiled(out, s.inbox[s.rank], &dims, &strides, &[c_box as u32, BM as u32, 1])?;
            if p.rs_c_store != RS_C_REGISTERS {
                encode_box(out, &self.c, self.n, c_box, C_BOX_ROWS)?
            } else {
                tm_a
            }
        } else {
            tm_a
        };
        let (mut a, mut al, mut b, mut c) = (tm_a, tm_a_local, tm_b, tm_c);
        let mut args = [
            (&mut a as *mut TensorMap).cast::<c_void>(),
            (&mut al as *mut TensorMap).cast(),
            (&mut b as *mut TensorMap).cast(),
            (&mut c as *mut TensorMap).cast(),
            (&mut rs as *mut RsMaps).cast(),
            (&mut p as *mut Params).cast(),
        ];
        let f = kernels.function(self);
        // SAFETY: the arguments match the kernel's six parameters and live
        // until the call returns (the driver copies them).
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f.cu_function(),
                    grid,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    self.tile.smem_bytes() as u32,
                    stream.0 as sys::CUstream,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "launching symm's sm90 matmul",
        )
    }

    /// Whether C is stored by TMA from shared memory: a plain (not
    /// reduce-scatter) 16-bit C with 16-byte aligned rows, whose tiles never
    /// straddle two chunks (TMA clips at C's edges, not at a chunk's), and
    /// rows of whole 16-byte units: with n = 257 the store wrote past column
    /// n into a padded C's padding (gpu_sm90_matmul_padded_output, H200).
    fn c_through_tma(&self) -> bool {
        let el = self.out_dtype.size();
        self.scatter.is_none()
            && matches!(self.out_dtype, GemmDtype::BF16 | GemmDtype::F16)
            && self.c.ptr % 16 == 0
            && (self.c.ld * el) % 16 == 0
            && (self.n * el) % 16 == 0
            && (self.chunks() == 1 || self.chunk_rows % BM == 0)
            && self.tma_epilogue
    }

    /// Whether the reduce-scatter goes through TMA (rs_push): rows of C's
    /// type in whole 16-byte units (TMA wrote past a row's end otherwise,
    /// see `c_through_tma`) and inboxes at 16-byte aligned addresses (TMA's
    /// rule). Symmetric memory and the shape, so alike on every rank.
    fn rs_pushes(&self) -> bool {
        self.rs_push
            && (self.n * self.out_dtype.size()) % 16 == 0
            && self.scatter.as_ref().is_some_and(|s| s.inbox.iter().all(|&a| a % 16 == 0))
    }

    /// With rs_push, how this rank's own rows go to C (`SYMM_RS_C_*`): by
    /// TMA where C's address and row stride are 16-byte aligned (from the
    /// ring, or through the staging area: `rs_in_ring`), else from
    /// registers.
    fn rs_c_store(&self) -> i32 {
        if self.rs_adds() {
            RS_C_ADD
        } else if self.c.ptr % 16 != 0 || (self.c.ld * self.out_dtype.size()) % 16 != 0 {
            RS_C_REGISTERS
        } else if self.rs_in_ring {
            RS_C_RING
        } else {
            RS_C_STAGED
        }
    }

    /// Whether the peer stores its partials straight into C and the own
    /// tiles add theirs to them by TMA reduce-adds (`SYMM_RS_C_ADD` in the
    /// kernel), rather than the peer pushing into this rank's inbox for the
    /// own tiles to load, add and store: the one-wave narrow-tile launch at
    /// world 2 (one peer per tile), every rank's C contiguous and in
    /// symmetric memory (`Scatter::out`). That takes the partials' load
    /// off the end of the kernel. Alike on every rank: the shape, and C's
    /// memory, which the ranks agreed on.
    pub fn rs_adds(&self) -> bool {
        let contiguous = self.c.ld == self.n && self.c.ptr % 16 == 0;
        self.rs_add_c
            && self.chunks() == 2
            && self.narrow().is_some()
            && contiguous
            && self.scatter.as_ref().and_then(|s| s.out.as_ref()).is_some_and(|o| o.iter().all(|&a| a % 16 == 0))
    }

    fn params(&self) -> Params {
        let narrow = self.narrow();
        let mut order = [0i32; MAX_CHUNKS];
        for (o, &c) in order.iter_mut().zip(&self.order) {
            *o = c as i32;
        }
        let (mut inbox, mut rs_state) = ([0u64; MAX_CHUNKS], [0u64; MAX_CHUNKS]);
        let (mut rank, mut world, mut rs) = (0, self.chunks() as i32, 0);
        if let Some(s) = &self.scatter {
            inbox[..s.inbox.len()].copy_from_slice(&s.inbox);
            rs_state[..s.state.len()].copy_from_slice(&s.state);
            (rank, rs) = (s.rank as i32, 1);
        }
        if let Some(g) = &self.gather {
            rank = g.local_chunk as i32;
        }
        world = world.max(1);
        let (scale_mode, a_scale, b_scale, bias) = match self.fp8 {
            None => (SCALES_NONE, 0, 0, 0),
            Some(f) => (if f.row_wise { SCALES_ROW } else { SCALES_TENSOR }, f.a_scale, f.b_scale, f.bias),
        };
        Params {
            m: self.m as i32,
            n: self.n as i32,
            k: self.k as i32,
            out_dtype: self.out_dtype as i32,
            c: self.c.ptr,
            ldc: self.c.ld as i64,
            chunks: self.chunks() as i32,
            chunk_rows: self.chunk_rows as i32,
            order,
            local_chunk: self.gather.as_ref().map_or(-1, |g| g.local_chunk as i32),
            rs,
            ready: self.gather.as_ref().map_or(0, |g| g.ready),
            rank,
            world,
            inbox,
            rs_state,
            alpha: self.alpha,
            c_tma: 0,
            timeout_ns: self.timeout_ns,
            err: self.err,
            a_scale,
            b_scale,
            bias,
            a_scale_slot: self.gather.as_ref().map_or(self.chunk_rows, |g| g.scale_slot) as i64,
            scale_mode,
            rs_push: i32::from(self.rs_pushes()),
            slices: self.slices() as i32,
            slice_kblocks: self.slice_kblocks() as i32,
            trace: self.trace,
            rs_narrow_n: narrow.map_or(0, |w| w.tiles as i32),
            rs_narrow_w: narrow.map_or(0, |w| w.width as i32),
            rs_narrow_less: narrow.map_or(0, |w| w.narrower as i32),
            rs_c_store: RS_C_REGISTERS,
            rs_push_ring: i32::from(self.rs_push_ring),
            cut_n: 0,
            cut_w: 0,
        }
    }
}

/// The tile width for an `m x n` problem split into `chunks` row chunks on
/// `sms` multiprocessors: the one with fewer predicted tile-waves, where a
/// 128-wide tile costs a little more than half a 256-wide one.
pub fn choose_tile(m_chunk: usize, n: usize, chunks: usize, sms: usize) -> TileN {
    let cost = |t: TileN, rel: f64| {
        let tiles = m_chunk.div_ceil(BM) * n.div_ceil(t.cols()) * chunks;
        tiles.div_ceil(sms.max(1)) as f64 * rel
    };
    // Relative time of one tile: N128 does half the work, but loads more
    // per flop. Measured with the TMA-store epilogue (bench/KERNELS.md v4),
    // 16384x8192x8192: N128 0.958-0.978 of cuBLASLt on an H200 against
    // N256 0.964-0.999, but 1.145 against 0.975 on an H100 (less memory
    // bandwidth), so N128 must win on waves by a margin.
    if cost(TileN::N128, 0.56) < cost(TileN::N256, 1.0) {
        TileN::N128
    } else {
        TileN::N256
    }
}

/// The cut of each of `rows` row tiles' `n` columns into tiles of 232 to
/// 256 columns (the kernels' narrow k-loops; the first ones 8 wider, to
/// cover n) that gives the busiest of `ctas` CTAs at least 1% fewer
/// columns than 256-wide tiles do, the fewest tiles of the best, or None.
/// A persistent grid takes its busiest CTA's time, and a k-loop's time
/// goes with its tile's width (bench/KERNELS.md v21), so at 16384 x 8192
/// on 132 SMs 34 tiles per row tile (240 columns, the first 4 of 248)
/// leave the busiest CTA 7952 columns, where 32 of 256 (31.03 tiles per
/// CTA, so 32 tiles' time) leave it 8192. (A cut is a `NarrowPeers` with
/// no narrower tiles: the same widths, the same kernel arithmetic.)
pub fn column_cut(rows: usize, n: usize, ctas: usize) -> Option<NarrowPeers> {
    let wide = n.div_ceil(256);
    let cols8 = n.div_ceil(8);
    let wide_width = |i: usize| if i + 1 < wide { 256 } else { n - 256 * (wide - 1) };
    let uncut = busiest_cta_cols(rows, wide, ctas, wide_width);
    (wide + 1..=cols8 / 29)
        .filter_map(|tiles| {
            let cut = NarrowPeers { tiles, width: 8 * (cols8 / tiles), narrower: 0 };
            let extra = cut.wider(n).filter(|_| NarrowPeers::WIDTHS.contains(&cut.width))?;
            let width = |i: usize| cut.width + if i < extra { 8 } else { 0 };
            Some((busiest_cta_cols(rows, tiles, ctas, width), cut))
        })
        .filter(|&(cols, _)| 100 * cols <= 99 * uncut)
        .min_by_key(|&(cols, cut)| (cols, cut.tiles))
        .map(|(_, cut)| cut)
}

/// The most columns one CTA computes when `rows` row tiles of `tiles`
/// tiles each (tile i `width(i)` wide) are dealt to `ctas` CTAs in the
/// kernel's order (`symm_tiling::at`: groups of `GROUP_M` row tiles walked
/// column by column, tile t to CTA t mod the grid). Each column of a group
/// is a run of consecutive t, added to the CTAs it spans through a cyclic
/// difference array: a launch evaluates a few cuts, so this costs one step
/// per run, not per tile.
fn busiest_cta_cols(rows: usize, tiles: usize, ctas: usize, width: impl Fn(usize) -> usize) -> usize {
    let grid = ctas.min(rows * tiles).max(1);
    let (mut every, mut diff) = (0, vec![0isize; grid + 1]);
    for first_m in (0..rows).step_by(GROUP_M) {
        let group_m = (rows - first_m).min(GROUP_M);
        for tn in 0..tiles {
            let w = width(tn);
            // Tiles first_m * tiles + tn * group_m, and the next group_m - 1.
            let (start, len) = ((first_m * tiles + tn * group_m) % grid, group_m % grid);
            every += group_m / grid * w;
            let w = w as isize;
            diff[start] += w;
            if start + len <= grid {
                diff[start + len] -= w;
            } else {
                diff[grid] -= w;
                diff[0] += w;
                diff[start + len - grid] -= w;
            }
        }
    }
    let mut run = 0;
    let most = diff[..grid].iter().map(|d| {
        run += d;
        run
    });
    every + most.max().unwrap_or(0) as usize
}

/// `SYMM_SM90_TILE` (`128` or `256`): a forced tile width, for tuning. (It
/// showed that a reduce-scatter done in one wave of wide tiles should not
/// take two waves of narrow ones so that the peers' partials land earlier:
/// mm_rs 512 bound 0.230-0.232 ms against 0.205-0.213 on 2 x H200,
/// `bench/results/2026-11-26-h200-x2-7c99925-scatter-tiles.txt`.)
fn tile_override() -> Option<TileN> {
    match std::env::var("SYMM_SM90_TILE").as_deref() {
        Ok("128") => Some(TileN::N128),
        Ok("256") => Some(TileN::N256),
        _ => None,
    }
}

/// Narrow peer tiles for a reduce-scatter of `chunks` chunks of `m_chunk`
/// rows by `n` columns in 256-wide tiles on `sms` multiprocessors, where
/// they pay: the 256-wide tiles are one wave that leaves SMs idle, and the
/// peers' chunks then fill them with more tiles of 232 to 248 columns (the
/// widths the kernels have): at mm_rs M = 512 world 2, n = 8192, 68 tiles
/// on the 68 SMs the own chunk's 64 leave, per row tile 12 of 248 columns,
/// 14 of 240 and 8 of 232 (`staggered`; without, 4 of 248 and 30 of 240).
/// `None` where the tiles would not be narrower.
///
/// Staggered: a k-loop's time goes with its tile's width, so the three
/// widths end theirs ~5 us apart (0.61 us per column at this shape) and
/// the link, which takes ~11 us for the 4 MiB of partials (~380 GB/s,
/// `bench/gpu/push_probe.cu`), drains the first group's pushes before the
/// next group's come. A queue model of the link (k-loop ends from the v19
/// traces) put the last push ~2-3.5 us earlier with a quarter of the tiles
/// 8 narrower than with one width; measured on 2 x H200, pushes complete
/// ~4 us earlier at the median but the last flag only ~1 us (the push's
/// other costs, bench/KERNELS.md v21, v22).
pub fn narrow_peers(
    m_chunk: usize,
    n: usize,
    chunks: usize,
    sms: usize,
    narrower: Option<usize>,
) -> Option<NarrowPeers> {
    let tiles_m = m_chunk.div_ceil(BM);
    let wide = n.div_ceil(TileN::N256.cols());
    let own = tiles_m * wide;
    if chunks < 2 || own * chunks > sms {
        return None;
    }
    // As many as the idle SMs take, of 240 columns or more (the staggered
    // cut then narrows some to 232).
    let tiles = ((sms - own) / ((chunks - 1) * tiles_m)).min(n.div_ceil(8) / 30);
    if tiles <= wide {
        return None;
    }
    let width = 8 * (n.div_ceil(8) / tiles);
    let stagger = NarrowPeers { tiles, width, narrower: narrower.unwrap_or(tiles / 4) };
    if stagger.narrower > 0 && stagger.covers(n) {
        return Some(stagger);
    }
    let w = NarrowPeers { narrower: 0, ..stagger };
    w.covers(n).then_some(w)
}

/// The tile width of a fused call (`SYMM_SM90_TILE`, else by the shape).
fn fused_tile(m_chunk: usize, n: usize, chunks: usize) -> TileN {
    tile_override().unwrap_or_else(|| choose_tile(m_chunk, n, chunks, SHAPE_SMS))
}

/// The narrow peer tiles a fused 16-bit reduce-scatter of this shape uses
/// (256-wide tiles only, unless `SYMM_RS_NARROW=0`; of one width but the
/// few to cover n with `SYMM_RS_STAGGER=0`, see [`stagger_override`]):
/// the shape's alone, so that every rank cuts the chunks alike (set the
/// switches alike on every rank).
fn narrow_plan(m_chunk: usize, n: usize, chunks: usize) -> Option<NarrowPeers> {
    let wide = fused_tile(m_chunk, n, chunks) == TileN::N256 && narrow_allowed();
    wide.then(|| narrow_peers(m_chunk, n, chunks, SHAPE_SMS, stagger_override())).flatten()
}

/// Whether the fused reduce-scatter should be chosen over the pipelined
/// path: 16-bit inputs where its peers' tiles are narrow ([`narrow_peers`])
/// and the wave of 256-wide tiles is nearly full (at least 90% of the SMs:
/// where half of them would idle, as at M = 256 or n = 4096, cuBLAS's
/// smaller tiles fill the GPU in the pipelined path, and the fused kernel
/// was 1.09-1.26 x slower there in session 20's probe, before v19; not
/// measured since). Measured at mm_rs
/// 512x14336x8192 on 2 x H200 (bench/KERNELS.md v19): bound 0.1879-0.1893 ms
/// against 0.1975-0.1977 for the pipelined path, 0.1986-0.1999 against
/// 0.2005-0.2016 replayed from graphs, and 189 against 195 us one call at a
/// time. Elsewhere (more waves) the pipelined path stays ahead or level.
pub fn fused_scatter_preferred(chunk_rows: usize, n: usize, chunks: usize, in_elem: usize) -> bool {
    let wide_tiles = chunks * chunk_rows.div_ceil(BM) * n.div_ceil(TileN::N256.cols());
    in_elem == 2 && 10 * wide_tiles >= 9 * SHAPE_SMS && narrow_plan(chunk_rows, n, chunks).is_some()
}

/// `SYMM_RS_STAGGER=<count>`: how many narrow peer tiles per row tile are
/// 8 columns narrower (0: one width), instead of a quarter of them (for
/// comparisons; set alike on every rank).
fn stagger_override() -> Option<usize> {
    std::env::var("SYMM_RS_STAGGER").ok().and_then(|v| v.parse().ok())
}

/// `SYMM_RS_NARROW=0` keeps the peers' tiles as wide as the own ones (for
/// comparisons; set alike on every rank).
fn narrow_allowed() -> bool {
    knob_on("SYMM_RS_NARROW")
}

/// A kernel variant's switch for comparisons: on unless `var` is "0".
fn knob_on(var: &str) -> bool {
    std::env::var(var).as_deref() != Ok("0")
}

/// Element type of a tensor map: C's or a 16-bit input's type, or bytes
/// (fp8: TMA only moves them).
#[derive(Clone, Copy)]
enum MapType {
    Elem(GemmDtype),
    Byte,
}

impl MapType {
    fn size(self) -> usize {
        match self {
            MapType::Elem(t) => t.size(),
            MapType::Byte => 1,
        }
    }
}

/// A 2-D tensor map over `o` (`o.rows` rows of `k` elements) with boxes of
/// `box_rows` rows of a k-block (128 bytes), 128-byte swizzle, zeros outside.
fn encode(ty: MapType, o: &Operand, k: usize, box_rows: usize) -> Result<TensorMap> {
    encode_box(ty, o, k, BK_BYTES / ty.size(), box_rows)
}

/// As [`encode`], boxes of `box_rows x box_cols` elements (`box_cols`
/// times the element size must be 128 bytes for the swizzle).
fn encode_box(ty: MapType, o: &Operand, k: usize, box_cols: usize, box_rows: usize) -> Result<TensorMap> {
    encode_tiled(
        ty,
        o.ptr,
        &[k as u64, o.rows as u64],
        &[(o.ld * ty.size()) as u64],
        &[box_cols as u32, box_rows as u32],
    )
}

/// A tensor map of `dims` (innermost first) at `base`, `strides` bytes
/// between the outer dimensions' elements, boxes of `boxes`, 128-byte
/// swizzle, zeros outside.
fn encode_tiled(ty: MapType, base: u64, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<TensorMap> {
    use sys::CUtensorMapDataType::*;
    let data_type = match ty {
        MapType::Elem(GemmDtype::F16) => CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        MapType::Elem(GemmDtype::F32) => CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        MapType::Elem(_) => CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        MapType::Byte => CU_TENSOR_MAP_DATA_TYPE_UINT8,
    };
    let elem_strides = [1u32; 3];
    assert!(
        strides.len() + 1 == dims.len() && boxes.len() == dims.len() && dims.len() <= elem_strides.len(),
        "one stride per outer dimension, at most 3 dimensions"
    );
    let mut map = TensorMap([0; 16]);
    // SAFETY: dims, boxes and elem_strides hold the rank's elements
    // (checked above; elem_strides at least), strides one fewer; the map is
    // 128 bytes, 64-byte aligned.
    check(
        unsafe {
            sys::cuTensorMapEncodeTiled(
                (&mut map as *mut TensorMap).cast(),
                data_type,
                dims.len() as u32,
                base as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        },
        "cuTensorMapEncodeTiled",
    )?;
    Ok(map)
}

#[cfg(test)]
mod tests;
