//! One launch of the sm90 matmul as the host describes it: operands,
//! modes (all-gather, reduce-scatter) and the choices made for them, from
//! the backend-neutral fused call; and why a problem does not qualify.

use super::launch::{RS_C_ADD, RS_C_REGISTERS, RS_C_RING};
use super::tiling::{choose_tile, column_cut, fused_tile, narrow_plan, NarrowPeers, TileN};
use super::{BK_BYTES, BM, MAX_CHUNKS, SHAPE_SMS};
use crate::array::{Array, DType};
use crate::backend::cuda::gemm::{Fp8, Fp8Params, GemmDtype};
use crate::backend::{FusedMatmul, FusedScatter};
use crate::error::{err, Result};

/// The GEMM element type of a backend dtype (16-bit floats and f32).
pub(crate) fn gemm_dtype(d: DType) -> Result<GemmDtype> {
    match d {
        DType::F32 => Ok(GemmDtype::F32),
        DType::BF16 => Ok(GemmDtype::BF16),
        DType::F16 => Ok(GemmDtype::F16),
        other => Err(err!(Unsupported, "{other} is not supported by the CUDA backend yet")),
    }
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
    /// The fused reduce-scatter epilogue: chunk `d` of the product's rows
    /// is rank `d`'s output, C this rank's chunk (sizes of the inboxes and
    /// states: see [`FusedScatter`]; `out`: see [`Sm90Matmul::rs_adds`]).
    pub scatter: Option<FusedScatter>,
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
    /// Reduce-scatter: the peers' chunks in narrower tiles on the SMs a
    /// wave of 256-wide tiles leaves idle (see [`narrow_peers`](super::tiling::narrow_peers)); used
    /// with rs_push only.
    pub rs_narrow: Option<NarrowPeers>,
    /// A plain or gathered matmul: its columns cut into tiles that fill
    /// the grid's waves where that shortens the busiest CTA's share
    /// (default; false for comparisons; see [`Sm90Matmul::column_cut`]).
    pub column_cut: bool,
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
            rs_narrow: None,
            column_cut: true,
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
            mm.scatter = Some(s.clone());
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
    pub const SLICE_ALIGN: usize = super::SLICE_ALIGN;

    /// The all-gather's slices per chunk (1 without a gather).
    pub fn slices(&self) -> usize {
        self.gather.as_ref().map_or(1, |g| self.k.div_ceil(g.slice_k.max(1)))
    }

    /// k-blocks per slice of the all-gather (all of them in one slice).
    pub(super) fn slice_kblocks(&self) -> usize {
        let bk = BK_BYTES / self.in_size();
        match &self.gather {
            Some(g) if self.slices() > 1 => g.slice_k / bk,
            _ => self.k.div_ceil(bk),
        }
    }

    /// The narrow peer tiles this launch uses: where set, and the
    /// reduce-scatter goes through TMA (decided alike on every rank).
    pub fn narrow(&self) -> Option<NarrowPeers> {
        self.rs_narrow.filter(|_| self.rs_pushes() && self.fp8.is_none() && self.tile == TileN::N256)
    }

    /// Tiles of the whole launch with the column cut `cut`.
    pub(super) fn tiles_with(&self, cut: Option<NarrowPeers>) -> usize {
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
    pub(super) fn in_size(&self) -> usize {
        if self.fp8.is_some() {
            1
        } else {
            self.dtype.size()
        }
    }

    /// The grid and the column cut of a launch on `sm_count` SMs, the cut
    /// chosen once.
    pub(super) fn layout(&self, sm_count: u32) -> (u32, Option<NarrowPeers>) {
        let ctas = self.max_ctas(sm_count);
        let cut = self.column_cut(ctas);
        ((self.tiles_with(cut) as u32).min(ctas), cut)
    }

    /// CTAs the launch may use: one per SM, or `max_ctas`.
    pub(super) fn max_ctas(&self, sm_count: u32) -> u32 {
        sm_count.min(self.max_ctas.unwrap_or(u32::MAX)).max(1)
    }

    /// Whether C is stored by TMA from shared memory: a plain (not
    /// reduce-scatter) 16-bit C with 16-byte aligned rows, whose tiles never
    /// straddle two chunks (TMA clips at C's edges, not at a chunk's), and
    /// rows of whole 16-byte units: with n = 257 the store wrote past column
    /// n into a padded C's padding (gpu_sm90_matmul_padded_output, H200).
    pub(super) fn c_through_tma(&self) -> bool {
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
    pub(super) fn rs_pushes(&self) -> bool {
        self.rs_push
            && (self.n * self.out_dtype.size()) % 16 == 0
            && self.scatter.as_ref().is_some_and(|s| s.inbox.iter().all(|&a| a % 16 == 0))
    }

    /// With rs_push, how this rank's own rows go to C (`SYMM_RS_C_*`):
    /// added into it by the peers and TMA reduce-adds (`rs_adds`), else by
    /// TMA stores from the ring where C's address and row stride are
    /// 16-byte aligned, else from registers.
    pub(super) fn rs_c_store(&self) -> i32 {
        if self.rs_adds() {
            RS_C_ADD
        } else if self.c.ptr % 16 != 0 || (self.c.ld * self.out_dtype.size()) % 16 != 0 {
            RS_C_REGISTERS
        } else {
            RS_C_RING
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
        self.chunks() == 2
            && self.narrow().is_some()
            && contiguous
            && self.scatter.as_ref().and_then(|s| s.out.as_ref()).is_some_and(|o| o.iter().all(|&a| a % 16 == 0))
    }
}
