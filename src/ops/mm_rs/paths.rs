//! How a prepared `mm_rs` runs on each of its paths: the products, the
//! signals and pulls, and the reductions (which path, `MmRsPrepared::execute`).

use super::{partial_dtype, MmRs, MmRsPrepared, MmRsScales, ReduceOp, MAX_PIECES};
use crate::array::{Array, DType};
use crate::backend::{FusedMatmul, FusedScatter, GemmScales, Quantize};
use crate::error::Result;
use crate::ops::scaled::Mode;
use crate::ops::state::Scratch;
use crate::ops::{batched_operands, fused, Exec};

/// Signal channel announcing "the chunk for you is in my workspace", and
/// the channels after it, one per piece of [`MmRsPrepared::pipelined_onto_pulls`].
const READY: usize = crate::ops::CHANNEL + 1;
const _: () = assert!(READY + MAX_PIECES <= crate::backend::SIGNAL_CHANNELS);

impl MmRsPrepared {
    /// Fused (dim 0 of matrices, see `fused_field`): one kernel, and no
    /// barrier before it. The peers' chunks first (rank+1 first), each tile
    /// pushed into the destination's inbox slot for this rank once that
    /// rank's previous call has read its inbox, and flagged; this rank's own
    /// chunk last, each tile summed with the peers' partials as their flags
    /// arrive and written to `out`. The kernel keeps the count of calls
    /// that this takes in the flags buffer (`FusedScatter`).
    pub(super) fn fused(&self, ex: &Exec<'_>) -> Result<()> {
        let MmRs { a, b, out, .. } = &self.call;
        let (me, world) = (ex.rank(), ex.world());
        let backend = ex.group.backend();
        let lhs = a.as_matrix().expect("checked by fused_field");
        let rows = lhs.shape[0] / world;
        let scale = match self.call.op {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / world as f32,
        };
        // Row-wise scales packed into one vector (the packing copy runs
        // before the kernel on this stream); chunk c's rows at c * rows.
        let scales = self.scales(ex, self.call.scales.a_scale.as_ref())?;
        let call = FusedMatmul {
            order: (1..=world).map(|i| (me + i) % world).collect(),
            scatter: Some(FusedScatter {
                rank: me,
                inbox: ex.on_every_rank(Scratch::Mailbox, self.inbox)?,
                state: ex.on_every_rank(Scratch::Flags, self.state)?,
                out: match &self.symmetric_out {
                    Some(place) => Some((0..world).map(|r| place.on(r)).collect::<Result<_>>()?),
                    None => None,
                },
                tag: ex.tag,
            }),
            alpha: scale,
            timeout: ex.group.timeout(),
            ..fused::prototype(lhs, b.clone(), out.as_row_major_matrix().expect("checked"), scales, rows, world)
        };
        backend.fused_matmul(&call, ex.stream)
    }

    /// (Part of) `a` as the left operand: a matrix, packed where its
    /// strides do not allow one (or, for fp8, are not K-major).
    pub(super) fn lhs(&self, ex: &Exec<'_>, a: &Array) -> Result<Array> {
        match self.mode {
            Some(_) => ex.k_major_matrix(a, self.packed_a),
            None => ex.matrix(a, self.packed_a),
        }
    }

    /// The scales of an fp8 call for the rows of `a_scale` given (all of
    /// it, or the slice of one chunk), over all of `b`'s columns.
    pub(super) fn scales(&self, ex: &Exec<'_>, a_scale: Option<&Array>) -> Result<Option<GemmScales>> {
        let (Some(mode), Some(a_scale)) = (self.mode, a_scale) else { return Ok(None) };
        let s = &self.call.scales;
        let b_scale = s.b_scale.as_ref().expect("an fp8 call has a B scale");
        let a = ex.vector(a_scale, self.packed_scale.expect("planned for fp8 calls"))?;
        // An fp8 `out`'s bias is added once, after the sum.
        let bias = s.bias.as_ref().filter(|_| self.call.out.dtype.fp8().is_none());
        let (b, bias) = ex.b_vectors(b_scale, bias, self.b_vectors.expect("planned for fp8 calls"))?;
        Ok(Some(GemmScales { row_wise: mode == Mode::Row, a, b, bias }))
    }

    /// A chunk of the product (or of the reduction) at `addr`.
    /// Whether this rank is the group's only one and the call is a plain
    /// matmul into `out` (no fp8 or other options, `out` a matrix): the
    /// sum over one rank is the product itself, which then goes straight
    /// into `out` instead of through the workspace.
    pub(super) fn alone(&self, ex: &Exec<'_>) -> bool {
        let c = &self.call;
        ex.world() == 1 && self.mode.is_none() && c.scales == MmRsScales::default() && c.out.as_matrix().is_some()
    }

    /// [`Self::alone`]'s call (sum and avg alike over one rank).
    pub(super) fn multiply_alone(&self, ex: &Exec<'_>) -> Result<()> {
        self.multiply_into(ex, &self.call.out, &self.call.a, None, false)
    }

    pub(in crate::ops) fn chunk(&self, addr: u64) -> Array {
        Array::contiguous(addr, partial_dtype(&self.call.out), &self.call.out.shape)
    }

    /// After a barrier, the reduction reads every rank's chunk for this rank
    /// where it lies (over the links for peers): fewest steps, for small
    /// problems.
    pub(super) fn sequential(&self, ex: &Exec<'_>) -> Result<()> {
        ex.barrier()?;
        let me = ex.rank();
        let srcs: Vec<Array> =
            (0..ex.world()).map(|q| Ok(self.chunk(ex.at(q, self.chunks[me])?))).collect::<Result<_>>()?;
        self.reduce_into_out(ex, &srcs)?;
        // No rank's next call may overwrite chunks a peer still reads.
        ex.barrier()
    }

    /// Sequential at small chunks (`Decision::lines`), after the products:
    /// one launch of the device-side reduce-scatter pushes each chunk to
    /// its rank (as LL lines or in flagged pieces: no barrier before or
    /// after) and sums this rank's, scaled for avg, into `out` where it is
    /// contiguous in the partials' type, else into the workspace, finished
    /// there as [`Self::reduce_into_out`] finishes.
    pub(super) fn reduce_on_device(&self, ex: &Exec<'_>) -> Result<()> {
        let out = &self.call.out;
        let scale = match self.call.op {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / ex.world() as f32,
        };
        let input = ex.local(self.chunks[0]);
        if self.rounded.is_none() && out.is_contiguous() {
            return ex.device_reduce_scatter(input, out, scale);
        }
        let reduced = self.chunk(ex.local(self.reduced));
        ex.device_reduce_scatter(input, &reduced, scale)?;
        match self.rounded {
            Some(rounded) => self.quantize_into_out(ex, &reduced, rounded),
            None => ex.copy(out, &reduced),
        }
    }

    /// Pipelined: the chunks for the peers first (rank+1, rank+2, ...),
    /// each announced to its destination by a signal as soon as it is
    /// computed; a side stream pulls the chunks the peers computed for this
    /// rank (copy engines on CUDA) while the main stream computes the rest;
    /// the final reduction reads local memory only. The side stream forks
    /// after the first product: forked before it, a graph's replay may
    /// start the side's first wait (a kernel polling for the peer's signal)
    /// before the matmul, which then runs without that SM for the whole
    /// wait (its first matmul 0.296 -> 0.36 ms at 8192x7168x4096 on two
    /// H200s); the peer's signal comes after its own first product anyway.
    pub(super) fn pipelined(&self, ex: &Exec<'_>) -> Result<()> {
        if let Some(pieces) = self.onto_pieces {
            return self.pipelined_onto_pulls(ex, pieces);
        }
        let (world, me) = (ex.world(), ex.rank());
        let whole_a = self.whole_a(ex)?;
        let (side, signals) = (ex.side()?, ex.signal_side()?);
        for step in 1..=world {
            let r = (me + step) % world;
            self.product(ex, r, whole_a.as_ref())?;
            if step == 1 {
                ex.fork(side)?; // after the first product (see above)
            }
            if r != me {
                // From a stream of its own: a signal kernel first waits for
                // the peer to have taken the previous one, which on the
                // main stream held the next matmul back (7 us between the
                // two at 512x14336x8192 on two H100s).
                ex.fork(signals)?;
                ex.put_signal(r, READY, signals)?;
            }
        }
        for step in 1..world {
            let q = (me + world - step) % world;
            ex.wait_signal(q, READY, side)?;
            ex.copy_on(side, &self.chunk(ex.local(self.staged[q])), &self.chunk(ex.at(q, self.chunks[me])?))?;
        }
        ex.join(side)?;
        // Once every rank has pulled its chunks (side barrier), the next
        // call may overwrite them; that barrier overlaps the reduction.
        ex.barrier_on(side)?;
        let srcs: Vec<Array> =
            (0..world).map(|q| self.chunk(ex.local(if q == me { self.chunks[me] } else { self.staged[q] }))).collect();
        self.reduce_into_out(ex, &srcs)?;
        if world > 1 {
            // Forked only for a chunk sent to a peer; joining a stream not
            // forked in a graph capture would end the capture.
            ex.join(signals)?;
        }
        ex.join(side)
    }

    /// Scattering N multiplies all of `a` (as a matrix, with its scales)
    /// by column slices of `b` (and of its scales and bias): that matrix.
    fn whole_a(&self, ex: &Exec<'_>) -> Result<Option<(Array, Option<GemmScales>)>> {
        let a = &self.call.a;
        if self.dim != a.ndim() - 1 {
            return Ok(None);
        }
        Ok(Some((self.lhs(ex, a)?, self.scales(ex, self.call.scales.a_scale.as_ref())?)))
    }

    /// Chunk r of this rank's product, into `chunks[r]` (`whole_a`: see
    /// [`Self::whole_a`]).
    fn product(&self, ex: &Exec<'_>, r: usize, whole_a: Option<&(Array, Option<GemmScales>)>) -> Result<()> {
        let MmRs { a, b, out, .. } = &self.call;
        let (dim, len, a_scale) = (self.dim, out.shape[self.dim], self.call.scales.a_scale.as_ref());
        let (lhs, rhs, scales) = match whole_a {
            Some((m, s)) => (m.clone(), b.narrow(1, r * len, len), s.as_ref().map(|s| s.columns(r * len, len))),
            None => {
                let part = a.narrow(dim, r * len, len);
                if self.mode.is_none() {
                    return self.multiply_into(ex, &self.chunk(ex.local(self.chunks[r])), &part, None, false);
                }
                let rows = a_scale.filter(|_| self.mode == Some(Mode::Row)).map(|s| s.narrow(dim, r * len, len));
                let scales = self.scales(ex, rows.as_ref().or(a_scale))?;
                (self.lhs(ex, &part)?, b.clone(), scales)
            }
        };
        let dst = Array::contiguous(ex.local(self.chunks[r]), partial_dtype(out), &[lhs.shape[0], rhs.shape[1]]);
        ex.matmul(&dst, &lhs, &rhs, scales.as_ref())
    }

    /// Every chunk of this rank's product, each in its place (`chunk(r)`):
    /// what a group spanning hosts reduces across its levels.
    pub(in crate::ops) fn products(&self, ex: &Exec<'_>) -> Result<()> {
        let whole_a = self.whole_a(ex)?;
        (0..ex.world()).try_for_each(|r| self.product(ex, r, whole_a.as_ref()))
    }

    /// Bytes of one chunk of the product.
    pub(in crate::ops) fn chunk_bytes(&self) -> usize {
        self.call.out.numel() * partial_dtype(&self.call.out).size()
    }

    /// Rank r's chunk of this rank's product (after [`Self::products`]).
    pub(in crate::ops) fn product_chunk(&self, ex: &Exec<'_>, r: usize) -> Array {
        self.chunk(ex.local(self.chunks[r]))
    }

    /// Pipelined for two ranks without the final pass over the chunk: the
    /// peer's chunk first, announced whole, or in the pieces below where
    /// the cost model found its pull exposed (`decision.pieces`): then the
    /// peer starts pulling after the first piece. Then this rank's own
    /// chunk in pieces, each but the first multiplied onto the peer's
    /// partial for it, which the side stream has pulled into `out` (or,
    /// where `out` is not contiguous, the workspace's reduced chunk)
    /// meanwhile (C += A @ B, one rounding). Only the first piece, computed
    /// before any partial has arrived, is summed by a reduction at the end.
    /// This saves a final pass that read two chunks and wrote one after the
    /// last matmul (about 7% of the call at 16384x4096x8192 on two H100s,
    /// bench/results/). Pieces are runs of the chunk's first dimension:
    /// rows of a matrix, or the batch of a `[batch, seq, hidden]` scattered
    /// along its sequence.
    fn pipelined_onto_pulls(&self, ex: &Exec<'_>, pieces: usize) -> Result<()> {
        let MmRs { a, out, .. } = &self.call;
        let (me, units) = (ex.rank(), out.shape[0]);
        let peer = 1 - me;
        // Rows of a matrix: `a` as one (packed where it is not).
        let lhs = if self.dim == 0 { Some(self.lhs(ex, a)?) } else { None };
        let a_part = |r: usize, start: usize, len: usize| match &lhs {
            Some(m) => m.narrow(0, r * units + start, len),
            None => a.narrow(0, start, len).narrow(self.dim, r * out.shape[self.dim], out.shape[self.dim]),
        };
        // fp8 (rows of a matrix only): the scales of those rows.
        let a_scale = self.call.scales.a_scale.as_ref();
        let scale_part = |r: usize, start: usize, len: usize| match (self.mode, a_scale) {
            (Some(Mode::Row), Some(s)) => Some(s.narrow(0, r * units + start, len)),
            (_, s) => s.cloned(),
        };
        let bound = |j: usize| j * units / pieces;
        let span = |j: usize| (bound(j), bound(j + 1) - bound(j));
        let piece = |t: &Array, j: usize| {
            let (start, len) = span(j);
            t.narrow(0, start, len)
        };
        // The pieces in the order they are pulled: the first is summed last.
        let order = || (1..pieces).chain([0]);
        let in_pieces = self.decision.pieces > 1;
        let (side, signals) = (ex.side()?, ex.signal_side()?);
        let theirs = self.chunk(ex.local(self.chunks[peer]));
        let announced: Vec<(usize, usize)> = match in_pieces {
            true => order().map(span).collect(),
            false => vec![(0, units)],
        };
        // A channel per piece: a second signal on one channel would wait
        // for the peer to take the first, which a backend running its
        // streams one after another never does.
        for (i, &(start, len)) in announced.iter().enumerate() {
            self.multiply_into(
                ex,
                &theirs.narrow(0, start, len),
                &a_part(peer, start, len),
                scale_part(peer, start, len).as_ref(),
                false,
            )?;
            if i == 0 {
                ex.fork(side)?; // after the first product, as in `pipelined`
            }
            ex.fork(signals)?; // as in `pipelined`
            ex.put_signal(peer, READY + i, signals)?;
        }
        let target = match out.is_contiguous() {
            true => out.clone(),
            false => self.chunk(ex.local(self.reduced)),
        };
        let pulled = self.chunk(ex.at(peer, self.chunks[me])?);
        let (own, staged) = (self.chunk(ex.local(self.chunks[me])), self.chunk(ex.local(self.staged[peer])));
        let (start, len) = span(0);
        self.multiply_into(ex, &piece(&own, 0), &a_part(me, start, len), scale_part(me, start, len).as_ref(), false)?;
        for (i, j) in order().enumerate() {
            if in_pieces || i == 0 {
                ex.wait_signal(peer, READY + i, side)?;
            }
            let into = if j == 0 { &staged } else { &target };
            ex.copy_on(side, &piece(into, j), &piece(&pulled, j))?;
            ex.join(side)?;
            if j != 0 {
                let (start, len) = span(j);
                self.multiply_into(
                    ex,
                    &piece(&target, j),
                    &a_part(me, start, len),
                    scale_part(me, start, len).as_ref(),
                    true,
                )?;
            }
        }
        // Once both ranks have pulled (side barrier), the next call may
        // overwrite the chunks; it overlaps the last reduction.
        ex.barrier_on(side)?;
        let mut srcs = [piece(&own, 0), piece(&staged, 0)];
        if me == 1 {
            srcs.swap(0, 1); // rank order, as reduce_into_out sums
        }
        ex.reduce(&piece(&target, 0), &srcs, 1.0)?;
        if !out.is_contiguous() {
            ex.copy(out, &target)?;
        }
        ex.join(signals)?;
        ex.join(side)
    }

    /// `dst` (a contiguous piece of a chunk) = (or, `accumulate`, +=)
    /// `part` (the slice of `a` it comes from, any strides) @ b: fp8 with
    /// `a_scale` (those rows' scales, or the tensor's) as one K-major
    /// matrix; else unscaled, as one matrix, else as a batch of strided
    /// matrices (a slice along the sequence of a `[batch, seq, hidden]`,
    /// read in place), else packed first.
    fn multiply_into(
        &self,
        ex: &Exec<'_>,
        dst: &Array,
        part: &Array,
        a_scale: Option<&Array>,
        accumulate: bool,
    ) -> Result<()> {
        let b = &self.call.b;
        let matrix = dst.as_matrix().expect("a contiguous piece");
        if let Some(scales) = self.scales(ex, a_scale)? {
            return ex.scaled_gemm(&matrix, &self.lhs(ex, part)?, b, &scales, accumulate);
        }
        if let Some(l) = part.as_matrix() {
            return ex.gemm(&matrix, &l, b, accumulate);
        }
        if let Some([d, l, rhs]) = batched_operands(dst, part, b) {
            return ex.gemm(&d, &l, &rhs, accumulate);
        }
        ex.gemm(&matrix, &self.lhs(ex, part)?, b, accumulate)
    }

    /// Sums `srcs` in rank order (so every rank's result is reproducible),
    /// scaled for avg, into `out`.
    pub(in crate::ops) fn reduce_into_out(&self, ex: &Exec<'_>, srcs: &[Array]) -> Result<()> {
        let out = &self.call.out;
        let scale = match self.call.op {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / ex.world() as f32,
        };
        if let Some(rounded) = self.rounded {
            return self.reduce_into_fp8(ex, srcs, scale, rounded);
        }
        if out.is_contiguous() {
            ex.reduce(out, srcs, scale)
        } else {
            let reduced = self.chunk(ex.local(self.reduced));
            ex.reduce(&reduced, srcs, scale)?;
            ex.copy(out, &reduced)
        }
    }

    /// An fp8 `out`: the f32 sum into the workspace, then its bias (world
    /// times for a sum: every rank's product had it) and result scale as it
    /// is rounded into `out` (a matrix), or into `rounded` and copied.
    fn reduce_into_fp8(&self, ex: &Exec<'_>, srcs: &[Array], scale: f32, rounded: usize) -> Result<()> {
        let reduced = self.chunk(ex.local(self.reduced));
        ex.reduce(&reduced, srcs, scale)?;
        self.quantize_into_out(ex, &reduced, rounded)
    }

    /// The f32 sum `reduced` with its bias and result scale, rounded into
    /// an fp8 `out` (a matrix), or into `rounded` and copied.
    fn quantize_into_out(&self, ex: &Exec<'_>, reduced: &Array, rounded: usize) -> Result<()> {
        let MmRs { a, out, op, scales, .. } = &self.call;
        let n = *out.shape.last().expect("out has dimensions");
        let sum = Array::contiguous(reduced.addr, DType::F32, &[out.numel() / n, n]);
        // Scattering N: this rank's columns of the bias.
        let bias = match &scales.bias {
            Some(b) if self.dim == a.ndim() - 1 => Some(b.narrow(0, ex.rank() * n, n)),
            other => other.clone(),
        };
        let bias_weight = match op {
            ReduceOp::Sum => ex.world() as f32,
            ReduceOp::Avg => 1.0,
        };
        let quantize = |dst: &Array| {
            let q = Quantize { dst, src: &sum, bias: bias.as_ref(), bias_weight, scale: scales.result_scale.as_ref() };
            ex.quantize(&q)
        };
        match out.as_matrix() {
            Some(m) => quantize(&m),
            None => {
                let staged = Array::contiguous(ex.local(rounded), out.dtype, &out.shape);
                quantize(&staged.as_matrix().expect("contiguous"))?;
                ex.copy(out, &staged)
            }
        }
    }
}
