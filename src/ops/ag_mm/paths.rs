//! How a prepared `fused_ag_mm` runs on each of its paths: the streams,
//! copies, signals and matmuls (which path, `AgMmPrepared::execute`).

use super::{row_scale_slot, writable_by_fp8, AgMm, AgMmPrepared, Rows};
use crate::array::{Array, DType};
use crate::backend::{check_copy, FusedGather, FusedMatmul, GemmScales, Quantize, Stream};
use crate::cost::{self, Algorithm};
use crate::error::{err, Result};
use crate::ops::scaled::Mode;
use crate::ops::{batched_operands, decide, fused, Exec};

/// Signal channels announcing the pushed pieces of a shard, one per piece.
const PUSHED: usize = crate::ops::CHANNEL + 1;
const _: () = assert!(PUSHED + cost::MAX_GATHER_PIECES <= crate::backend::SIGNAL_CHANNELS);

impl AgMmPrepared {
    /// Pulled: a side stream stages this rank's shard in its workspace,
    /// waits for every rank to be there, then pulls the peers' shards into
    /// this rank's workspace, rank-1 first. Pipelined: the main stream
    /// multiplies this rank's shard at once (from the caller's memory when
    /// it is a matrix) and each pulled shard as it lands, or each piece of
    /// it (`Self::pieces`). Sequential: one matmul over the gathered A once
    /// everything has landed (cuBLAS runs one large matmul faster than
    /// pieces, which pays when the pulls are short). Row scales travel with
    /// their shards.
    pub(super) fn pulled(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        let (dim, len, me, world) = (self.dim, a.shape[self.dim], ex.rank(), ex.world());
        let offset = |r: usize| self.shards + r * self.shard_bytes;
        let local_shard = |r: usize| self.staged_shard(ex, r);
        let gathers_k = dim == a.ndim() - 1;
        let whole =
            self.decision.algorithm == Algorithm::Sequential && !gathers_k && self.gathered_matrix(ex).is_some();
        let pipelined = !gathers_k && !whole;
        // Staging this rank's shard (for the peers to pull) is the side
        // stream's work, ahead of the barrier; this rank's own matmul reads
        // the shard where the caller has it, at once. (fp8 reads the staged
        // copy and its row scales, which want aligned, K-major rows.)
        let own_in_place = pipelined && self.mode.is_none() && a.as_matrix().is_some();
        // A shard in symmetric memory (not fp8) is pulled by the peers from
        // where the caller has it (agreed: its place is in the signature),
        // and staged only where this rank itself reads it from the
        // workspace (one matmul over the gathered A).
        let caller_place = self.symmetric_a.as_ref().filter(|_| self.mode.is_none());
        let peers_read_caller = caller_place.is_some();
        let stage_own = !peers_read_caller || !own_in_place;
        // A small shard is staged on the main stream, first: the driver
        // copies within a GPU on its multiprocessors, so on the side stream
        // the copy (and the barrier and pulls behind it) would wait for a
        // matmul holding every one of them, as a one-wave matmul at small M
        // does for all its time (27 us of 45 at ag_mm 512x4096x7168 on an
        // H200, bench/results/). So is one that no peer reads.
        let stage_first = self.shard_bytes <= cost::STAGED_SHARD_BYTES || peers_read_caller;
        if stage_first && stage_own {
            self.stage(ex, ex.stream)?;
        }
        let side = ex.side()?;
        ex.fork(side)?;
        if !stage_first {
            self.stage(ex, side)?;
            if pipelined && !own_in_place {
                ex.join(side)?;
            }
        }
        ex.barrier_on(side)?;
        if pipelined {
            let staged = local_shard(me);
            self.multiply_shard(ex, if own_in_place { a } else { &staged }, me, len)?;
        }
        // Pipelined, each peer's shard comes in the decision's pieces along
        // its first dimension, each multiplied once it has landed.
        let pieces = if pipelined { self.pieces() } else { 1 };
        for step in 1..world {
            let r = (me + world - step) % world;
            // Row scales (fp8: one piece) first, so that they have landed
            // with the shard.
            if self.row_scales.is_some() {
                let remote = self.row_scale_vector(ex.at(r, 0)?, r);
                ex.copy_on(side, &self.row_scale_vector(ex.local(0), r), &remote)?;
            }
            let at = match caller_place {
                Some(place) => place.on(r)?,
                None => ex.at(r, offset(r))?,
            };
            let remote = Array::contiguous(at, a.dtype, &a.shape);
            for (from, rows) in piece_ranges(a.shape[0], pieces) {
                let piece = |t: &Array| if pieces == 1 { t.clone() } else { t.narrow(0, from, rows) };
                ex.copy_on(side, &piece(&local_shard(r)), &piece(&remote))?;
                if pipelined {
                    ex.join(side)?;
                    self.multiply_rows(ex, &piece(&local_shard(r)), r, len, from, rows)?;
                }
            }
        }
        // The pulls have landed once the main stream joins the side here;
        // the closing barrier (every rank has pulled this rank's shard, so
        // the next call may overwrite it) then overlaps the matmuls below.
        ex.join(side)?;
        ex.barrier_on(side)?;
        self.finish(ex, whole, (!stage_own).then_some(a))?;
        ex.join(side)
    }

    /// Whether this rank is the group's only one and the call can multiply
    /// its shard where the caller has it (no fp8, a matrix, gathered along
    /// a dimension before the last, and `ag_out`, if any, a layout a copy
    /// from it can write): the gathered A is the shard itself, and staging
    /// it would only copy A (a matmul's 5-35% on an H200).
    pub(super) fn alone(&self, ex: &Exec<'_>) -> bool {
        let a = &self.call.a_shard;
        // The world first: every call of every group asks.
        ex.world() == 1
            && self.mode.is_none()
            && self.dim != a.ndim() - 1
            && a.as_matrix().is_some()
            && self.call.ag_out.as_ref().is_none_or(|ag| check_copy(ag, a).is_ok())
    }

    /// [`Self::alone`]'s call: every product from the caller's A, then
    /// `ag_out` (a copy of A).
    pub(super) fn multiply_alone(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        self.multiply_shard(ex, a, 0, a.shape[self.dim])?;
        self.finish(ex, false, Some(a))
    }

    /// Whether the ranks push their shards into each other's workspaces
    /// ([`Self::pipelined_pushed`]) instead of staging them to be pulled.
    /// From agreed inputs only, as the two exchange different signals:
    /// pipelined, gathering a dimension before the last, not fp8 (whose
    /// own matmul reads the staged shard and row scales), a shard not in
    /// symmetric memory (there the peers pull it in place), and larger than
    /// [`cost::STAGED_SHARD_BYTES`]: a smaller one stages in a few us, and its
    /// pull lands within this rank's own matmul with no kernel between the
    /// two matmuls, where a pushed one's signals (kernels) wait for a
    /// matmul holding every multiprocessor to end.
    pub(super) fn pushes(&self) -> bool {
        self.push && self.symmetric_a.is_none()
    }

    /// Pipelined with pushes: a side stream waits for every rank (barrier:
    /// a peer's workspace is free once its main stream has reached this
    /// call), then copies this rank's shard from the caller's memory
    /// straight into its slot in each peer's workspace (`rank+1` first, so
    /// that each step uses different links), a piece at a time, back to
    /// back. A third stream signals each piece once it has landed and waits
    /// for the same piece from `rank-1`, which the main stream then
    /// multiplies (kept off the copies' stream: a signal kernel may wait for
    /// a matmul to free a multiprocessor, and the next copy would wait with
    /// it). Against staging for pulls, this saves a copy on the SMs ahead
    /// of the matmuls (31 us for a 64 MiB shard on an H200, bench/results/)
    /// and the closing barrier: no peer reads this rank's memory, and every
    /// piece sent here has landed once it is multiplied. A shard the copy
    /// engines cannot read as it lies (no row-major matrix, or with
    /// `ag_out` not contiguous) is staged first and pushed from there.
    pub(super) fn pipelined_pushed(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        let (len, me, world) = (a.shape[self.dim], ex.rank(), ex.world());
        let in_place = a.is_contiguous() || (a.as_row_major_matrix().is_some() && self.call.ag_out.is_none());
        let own = match in_place {
            true => a.clone(),
            false => {
                self.stage(ex, ex.stream)?;
                self.staged_shard(ex, me)
            }
        };
        let (side, signals) = (ex.side()?, ex.signal_side()?);
        ex.fork(side)?;
        ex.barrier_on(side)?;
        self.multiply_shard(ex, &own, me, len)?;
        let pieces = self.pieces();
        for step in 1..world {
            let (to, from) = ((me + step) % world, (me + world - step) % world);
            let theirs = Array::contiguous(ex.at(to, self.shards + me * self.shard_bytes)?, a.dtype, &a.shape);
            let landed = self.staged_shard(ex, from);
            for (j, (start, rows)) in piece_ranges(a.shape[0], pieces).enumerate() {
                let piece = |t: &Array| if pieces == 1 { t.clone() } else { t.narrow(0, start, rows) };
                ex.copy_on(side, &piece(&theirs), &piece(&own))?;
                ex.stream_after(signals, side)?;
                ex.put_signal(to, PUSHED + j, signals)?;
                ex.wait_signal(from, PUSHED + j, signals)?;
                ex.join(signals)?;
                self.multiply_rows(ex, &piece(&landed), from, len, start, rows)?;
            }
        }
        self.finish(ex, false, in_place.then_some(a))?;
        ex.join(side)
    }

    /// The pieces the pipelined path pulls each peer's shard in, along its
    /// first dimension (contiguous runs of the staged shard): the
    /// decision's, at most `Shape::split_len` (the shard's length there
    /// where the call gathers a dimension before the last and is not fp8,
    /// else 1) and [`cost::MAX_GATHER_PIECES`] (a signal channel each when
    /// pushed).
    pub(super) fn pieces(&self) -> usize {
        self.decision.pieces.clamp(1, self.shape.split_len.clamp(1, cost::MAX_GATHER_PIECES))
    }

    /// Sequential at small shards (`Decision::lines`): every rank's shard
    /// into its place in this rank's workspace by one launch of the
    /// device-side all-gather over the group's all-reduce buffer, whose LL
    /// lines carry their own flags (no barrier, no copy engine: a few us
    /// where the copies cost ~25), and row scales by a second. A strided
    /// shard (or scale vector) is first packed apart.
    pub(super) fn gather_on_lines(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        let input = match (a.is_contiguous(), self.lines_input) {
            (true, _) => a.addr,
            (false, Some(at)) => {
                ex.copy(&Array::contiguous(ex.local(at), a.dtype, &a.shape), a)?;
                ex.local(at)
            }
            (false, None) => return Err(err!(Internal, "a strided shard on the lines has no packing region")),
        };
        ex.all_gather_lines(input, ex.local(self.shards), self.shard_bytes)?;
        // Row scales: a second gather into their slots, back to back
        // (`Shape::lines` holds them unpadded).
        let (Some(slots), Some(a_scale)) = (self.row_scales, &self.call.scales.a_scale) else { return Ok(()) };
        let input = match (a_scale.is_contiguous(), self.lines_scales_input) {
            (true, _) => a_scale.addr,
            (false, Some(at)) => {
                ex.copy(&Array::contiguous(ex.local(at), DType::F32, &a_scale.shape), a_scale)?;
                ex.local(at)
            }
            (false, None) => return Err(err!(Internal, "strided row scales on the lines have no packing region")),
        };
        ex.all_gather_lines(input, ex.local(slots), 4 * self.shard_rows())
    }

    /// Once every rank's shard (and row scales) lies in this rank's
    /// workspace: `ag_out`, and the products not made shard by shard (one
    /// matmul over the gathered A when `whole`; over the whole K when
    /// gathering K).
    /// `own`: where this rank's shard is read for `ag_out` where it is not
    /// staged.
    fn finish(&self, ex: &Exec<'_>, whole: bool, own: Option<&Array>) -> Result<()> {
        let AgMm { a_shard: a, bs, ag_out, outs, .. } = &self.call;
        let (dim, len, world) = (self.dim, a.shape[self.dim], ex.world());
        if let Some(ag) = ag_out {
            for r in 0..world {
                let shard = match own {
                    Some(own) if r == ex.rank() => own.clone(),
                    _ => self.staged_shard(ex, r),
                };
                ex.copy(&ag.narrow(dim, r * len, len), &shard)?;
            }
        }
        if whole {
            let lhs = self.gathered_matrix(ex).expect("checked by the caller");
            for (i, (b, out)) in bs.iter().zip(outs).enumerate() {
                let m = self.direct_output(out).expect("checked by gathered_matrix");
                ex.matmul(&m, &lhs, b, self.scales(ex, i, Rows::All)?.as_ref())?;
            }
        }
        if let Some(offset) = self.gathered_k {
            // Lay the shards side by side (pitched copies), then one matmul
            // over the whole K per B.
            let mut shape = a.shape.clone();
            shape[dim] *= world;
            let gathered = Array::contiguous(ex.local(offset), a.dtype, &shape);
            for r in 0..world {
                ex.copy(&gathered.narrow(dim, r * len, len), &self.staged_shard(ex, r))?;
            }
            for (i, out) in outs.iter().enumerate() {
                self.gemm_into(ex, i, out, &gathered, Rows::All)?;
            }
        }
        Ok(())
    }

    /// Copies this rank's shard (and row scales) into their places in its
    /// workspace, on `stream`.
    pub(in crate::ops) fn stage(&self, ex: &Exec<'_>, stream: Stream) -> Result<()> {
        ex.copy_on(stream, &self.staged_shard(ex, ex.rank()), &self.call.a_shard)?;
        if let (Some(a_scale), true) = (&self.call.scales.a_scale, self.row_scales.is_some()) {
            let staged = Array::contiguous(self.row_scale_addr(ex.local(0), ex.rank()), DType::F32, &a_scale.shape);
            ex.copy_on(stream, &staged, a_scale)?;
        }
        Ok(())
    }

    /// Bytes of the largest piece a rank contributes to the gather (its
    /// shard, or its row scales).
    pub(in crate::ops) fn piece_bytes(&self) -> usize {
        self.shard_bytes.max(4 * self.shard_rows())
    }

    /// Rank r's shard where it lies in this rank's workspace once gathered.
    pub(in crate::ops) fn staged_shard(&self, ex: &Exec<'_>, r: usize) -> Array {
        let a = &self.call.a_shard;
        Array::contiguous(ex.local(self.shards + r * self.shard_bytes), a.dtype, &a.shape)
    }

    /// Rank r's row scales (row-wise fp8 calls) where they lie in this
    /// rank's workspace once gathered.
    pub(in crate::ops) fn staged_row_scales(&self, ex: &Exec<'_>, r: usize) -> Option<Array> {
        self.row_scales.map(|_| self.row_scale_vector(ex.local(0), r))
    }

    /// Every output (and `ag_out`) from every rank's shard and row scales
    /// already in this rank's workspace (where a group spanning hosts
    /// gathers them): one matmul over the gathered A where it is one
    /// matrix, else shard by shard, or over the whole K.
    pub(in crate::ops) fn multiply_gathered(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        let gathers_k = self.dim == a.ndim() - 1;
        let whole = !gathers_k && self.gathered_matrix(ex).is_some();
        if !gathers_k && !whole {
            for r in 0..ex.world() {
                self.multiply_shard(ex, &self.staged_shard(ex, r), r, a.shape[self.dim])?;
            }
        }
        self.finish(ex, whole, None)
    }

    /// Across hosts (`super::across_matmul`): whether this rank's own
    /// shard is multiplied while the others are gathered
    /// (`decide::across_hosts_overlap`).
    pub(in crate::ops) fn overlaps_gather(&self, world: usize) -> bool {
        let a = &self.call.a_shard;
        let gathers_k = self.dim == a.ndim() - 1;
        let rows = a.numel() / a.shape[a.ndim() - 1].max(1);
        !gathers_k && world > 1 && decide::across_hosts_overlap(rows, a.dtype)
    }

    /// The products of the shards of `ranks`, from where they are staged
    /// (their row scales too), as soon as those have landed.
    pub(in crate::ops) fn multiply_staged(&self, ex: &Exec<'_>, ranks: &[usize]) -> Result<()> {
        let len = self.call.a_shard.shape[self.dim];
        ranks.iter().try_for_each(|&r| self.multiply_shard(ex, &self.staged_shard(ex, r), r, len))
    }

    /// Once every shard has landed and been multiplied: `ag_out`.
    pub(in crate::ops) fn finish_staged(&self, ex: &Exec<'_>) -> Result<()> {
        self.finish(ex, false, None)
    }

    /// Fused (gathering dim 0 into matrices, see `fused_field`): the main
    /// stream zeroes the arrival flags, stages this rank's shard for the
    /// peers, and launches one matmul per B, which starts with this rank's
    /// own rows read in place. A side stream forked before the matmuls (so
    /// it never waits for them) waits for every rank (barrier), pulls the
    /// peers' shards rank+1 first, each in slices of k flagged one by one
    /// (a tile waits only for the slice it reads next), and waits for
    /// every rank again (then nobody still reads a shard the next call
    /// overwrites). One multiprocessor is left to the side stream's barrier
    /// kernels.
    pub(super) fn fused(&self, ex: &Exec<'_>) -> Result<()> {
        let AgMm { a_shard: a, bs, ag_out, outs, .. } = &self.call;
        let (me, world) = (ex.rank(), ex.world());
        let backend = ex.group.backend();
        let lhs = a.as_matrix().expect("checked by fused_field");
        let (rows, k) = (lhs.shape[0], lhs.shape[1]);
        let slices = k / self.slice_k; // it divides k (cost::gather_slice_k)
        backend.zero(ex.local(self.ready), 4 * world * slices, ex.stream)?;
        // Staged for the peers on the main stream, before the matmul: a copy
        // within one device runs on the SMs (measured: on the side stream,
        // beside a persistent kernel that leaves it one SM, it made the
        // whole operation 9-12x slower).
        for (dst, src) in self.sliced(ex.local(self.shards), me, world, a) {
            ex.copy(&dst, &src)?;
        }
        if let (Some(a_scale), true) = (&self.call.scales.a_scale, self.row_scales.is_some()) {
            // This rank's row scales too: the kernel reads every chunk's
            // from the gathered slots.
            ex.copy(&Array::contiguous(self.row_scale_addr(ex.local(0), me), DType::F32, &a_scale.shape), a_scale)?;
        }
        let side = ex.side()?;
        ex.fork(side)?;
        // The matmuls are enqueued first, so they start while the host is
        // still issuing the side stream's work.
        let gathered = Array::contiguous(ex.local(self.shards), a.dtype, &[rows * world, k]);
        for (i, (b, out)) in bs.iter().zip(outs).enumerate() {
            let gather = FusedGather {
                ready: ex.local(self.ready),
                slice_k: self.slice_k,
                local_chunk: me,
                local: lhs.clone(),
                scale_slot: row_scale_slot(rows) / 4,
            };
            let scales = self.scales(ex, i, Rows::All)?;
            let c = out.as_row_major_matrix().expect("checked");
            let call = FusedMatmul {
                gather: Some(gather),
                order: (0..world).map(|i| (me + i) % world).collect(),
                spare_sms: 1,
                timeout: ex.group.timeout(),
                ..fused::prototype(gathered.clone(), b.clone(), c, scales, rows, world)
            };
            backend.fused_matmul(&call, ex.stream)?;
        }
        ex.barrier_on(side)?;
        for step in 1..world {
            let r = (me + step) % world;
            if self.row_scales.is_some() {
                let remote = self.row_scale_vector(ex.at(r, 0)?, r);
                ex.copy_on(side, &self.row_scale_vector(ex.local(0), r), &remote)?;
            }
            // Slice by slice, each one contiguous copy, flagged as it lands.
            for s in 0..slices {
                let block = |base: u64| self.slice_block(base, s, r, rows, world, a.dtype);
                ex.copy_on(side, &block(ex.local(self.shards)), &block(ex.at(r, self.shards)?))?;
                ex.ws()?.write_value(me, self.ready + 4 * (r * slices + s), 1, side)?;
            }
        }
        ex.barrier_on(side)?;
        ex.join(side)?;
        if let Some(ag) = ag_out {
            let len = a.shape[0];
            for r in 0..world {
                for (src, dst) in self.sliced(ex.local(self.shards), r, world, &ag.narrow(0, r * len, len)) {
                    ex.copy(&dst, &src)?;
                }
            }
        }
        Ok(())
    }

    /// The fused path's gathered A at `base` is slice-major,
    /// `[slices][rows * world][slice_k]` (row-major with one slice), so that
    /// a rank's slice is one contiguous block: that of rank `r`, slice `s`.
    pub(super) fn slice_block(&self, base: u64, s: usize, r: usize, rows: usize, world: usize, dtype: DType) -> Array {
        let w = self.slice_k;
        let at = base + ((s * rows * world + r * rows) * w * dtype.size()) as u64;
        Array::contiguous(at, dtype, &[rows, w])
    }

    /// Pairs (rank `r`'s rows in the gathered A at `base`, the same
    /// elements of `t`, shaped like a shard) to copy between them, either
    /// way: one pair when `t` is contiguous, else one per slice.
    pub(super) fn sliced(&self, base: u64, r: usize, world: usize, t: &Array) -> Vec<(Array, Array)> {
        let (w, k) = (self.slice_k, t.shape[t.ndim() - 1]);
        let (slices, rows) = (k / w, t.numel() / k);
        let block = |s| self.slice_block(base, s, r, rows, world, t.dtype);
        if t.is_contiguous() {
            // [rows, slices, w]: in the gathered A, slice planes apart.
            let g = block(0);
            let gathered = Array { shape: vec![rows, slices, w], strides: vec![w, rows * world * w, 1], ..g };
            return vec![(gathered, Array::contiguous(t.addr, t.dtype, &[rows, slices, w]))];
        }
        (0..slices)
            .map(|s| {
                let part = t.narrow(t.ndim() - 1, s * w, w);
                (Array::contiguous(block(s).addr, t.dtype, &part.shape), part)
            })
            .collect()
    }

    /// Rows of A per shard.
    fn shard_rows(&self) -> usize {
        let a = &self.call.a_shard;
        a.numel() / a.shape[a.ndim() - 1]
    }

    /// Where rank r's row scales lie in the workspace that starts at `base`.
    fn row_scale_addr(&self, base: u64, r: usize) -> u64 {
        let offset = self.row_scales.expect("row-wise call") + r * row_scale_slot(self.shard_rows());
        base + offset as u64
    }

    fn row_scale_vector(&self, base: u64, r: usize) -> Array {
        Array::contiguous(self.row_scale_addr(base, r), DType::F32, &[self.shard_rows()])
    }

    /// The scales of a matmul by `bs[i]` over `rows` of the gathered A, for
    /// an fp8 call.
    fn scales(&self, ex: &Exec<'_>, i: usize, rows: Rows) -> Result<Option<GemmScales>> {
        let Some(mode) = self.mode else { return Ok(None) };
        let s = &self.call.scales;
        let b_scale = &s.b_scales.as_ref().expect("an fp8 call has B scales")[i];
        let a = match (mode, rows) {
            (Mode::Tensor, _) => {
                let a_scale = s.a_scale.as_ref().expect("an fp8 call has an A scale");
                ex.vector(a_scale, self.tensor_scale.expect("planned for tensor-wise calls"))?
            }
            (Mode::Row, Rows::Shard(r)) => self.row_scale_vector(ex.local(0), r),
            (Mode::Row, Rows::All) => {
                Array::contiguous(self.row_scale_addr(ex.local(0), 0), DType::F32, &[self.shard_rows() * ex.world()])
            }
        };
        // An fp8 output's bias is added when it is rounded (`quantized`).
        let fp8_out = self.call.outs[i].dtype.fp8().is_some();
        let bias = s.biases.as_ref().and_then(|v| v[i].as_ref()).filter(|_| !fp8_out);
        let (b, bias) = ex.b_vectors(b_scale, bias, self.b_vectors[i])?;
        Ok(Some(GemmScales { row_wise: mode == Mode::Row, a, b, bias }))
    }

    /// The gathered A as one matrix in this rank's workspace, when it is one
    /// (gathering dim 0) and every output is a matrix too.
    /// Row scales must then form one vector too: no padding between the
    /// ranks' slots.
    fn gathered_matrix(&self, ex: &Exec<'_>) -> Option<Array> {
        let a = &self.call.a_shard;
        let padded_scales = self.row_scales.is_some() && row_scale_slot(self.shard_rows()) != self.shard_rows() * 4;
        let fp8_out = self.wide.is_some();
        if self.dim != 0 || padded_scales || fp8_out || self.call.outs.iter().any(|o| self.direct_output(o).is_none()) {
            return None;
        }
        let mut shape = a.shape.clone();
        shape[0] *= ex.world();
        Array::contiguous(ex.local(self.shards), a.dtype, &shape).as_matrix()
    }

    /// Shard r (staged, or this rank's input, a matrix either way) times
    /// every B, into slice r of each output.
    fn multiply_shard(&self, ex: &Exec<'_>, shard: &Array, r: usize, len: usize) -> Result<()> {
        self.multiply_rows(ex, shard, r, len, 0, shard.shape[0])
    }

    /// `rows` indices of shard r's first dimension from `from` (`lhs`,
    /// those of the shard, a matrix) times every B, into their place in
    /// each output: along the gathered dimension where that is the first,
    /// else those indices (of the batch) of the output's slice r.
    fn multiply_rows(&self, ex: &Exec<'_>, lhs: &Array, r: usize, len: usize, from: usize, rows: usize) -> Result<()> {
        for (i, out) in self.call.outs.iter().enumerate() {
            let dst = match self.dim {
                0 => out.narrow(0, r * len + from, rows),
                d => out.narrow(d, r * len, len).narrow(0, from, rows),
            };
            self.gemm_into(ex, i, &dst, lhs, Rows::Shard(r))?;
        }
        Ok(())
    }

    /// `dst = lhs @ bs[i]` over `rows` of the gathered A (`lhs`: those rows
    /// with `dst`'s leading shape, a matrix): straight into `dst` when it
    /// is a matrix (that an fp8 matmul can write: unit column stride,
    /// 16-byte aligned rows) or, unscaled, a batch of equally strided ones
    /// (a slice along a middle dimension: one strided-batched matmul); else
    /// into contiguous scratch of `dst`'s dtype and then copied (no
    /// conversion, so every backend's plain strided copy serves). An fp8
    /// `dst` goes through f32 (see [`Self::quantized`]).
    fn gemm_into(&self, ex: &Exec<'_>, i: usize, dst: &Array, lhs: &Array, rows: Rows) -> Result<()> {
        let (b, scales) = (&self.call.bs[i], self.scales(ex, i, rows)?);
        let matrix = lhs.as_matrix().expect("the shards and the gathered A are matrices");
        if dst.dtype.fp8().is_some() {
            return self.quantized(ex, i, dst, &matrix, scales.as_ref());
        }
        let scales = scales.as_ref();
        if let Some(m) = self.direct_output(dst) {
            return ex.matmul(&m, &matrix, b, scales);
        }
        if let Some([d, l, r]) = scales.is_none().then(|| batched_operands(dst, lhs, b)).flatten() {
            return ex.gemm(&d, &l, &r, false);
        }
        let product = Array::contiguous(ex.local(self.scratch), dst.dtype, &dst.shape);
        ex.matmul(&product.as_matrix().expect("contiguous"), &matrix, b, scales)?;
        ex.copy(dst, &product)
    }

    /// `dst` as the matrix a matmul writes in place: row-major, and for
    /// fp8 operands one that cuBLASLt's fp8 kernels can write (16-byte
    /// aligned rows); `None` sends the product through scratch.
    pub(super) fn direct_output(&self, dst: &Array) -> Option<Array> {
        dst.as_row_major_matrix().filter(|m| self.mode.is_none() || writable_by_fp8(m))
    }

    /// An fp8 output: `lhs @ bs[i]` scaled, in f32 in the workspace, then
    /// with its bias and result scale rounded once into `dst` (a matrix),
    /// or into scratch and copied (any other strides).
    fn quantized(&self, ex: &Exec<'_>, i: usize, dst: &Array, lhs: &Array, scales: Option<&GemmScales>) -> Result<()> {
        let b = &self.call.bs[i];
        let wide = self.wide.expect("workspace for fp8 outputs");
        let product = Array::contiguous(ex.local(wide), DType::F32, &[lhs.shape[0], b.shape[1]]);
        ex.matmul(&product, lhs, b, scales)?;
        let s = &self.call.scales;
        let entry = |v: &Option<Vec<Option<Array>>>| v.as_ref().and_then(|v| v[i].clone());
        let (bias, scale) = (entry(&s.biases), entry(&s.result_scales));
        let quantize = |dst: &Array| {
            let q = Quantize { dst, src: &product, bias: bias.as_ref(), bias_weight: 1.0, scale: scale.as_ref() };
            ex.quantize(&q)
        };
        match dst.as_matrix() {
            Some(m) => quantize(&m),
            None => {
                let staged = Array::contiguous(ex.local(self.scratch), dst.dtype, &dst.shape);
                quantize(&staged.as_matrix().expect("contiguous"))?;
                ex.copy(dst, &staged)
            }
        }
    }
}

/// `pieces` near-equal runs (from, length) covering `0..len`, none empty.
pub(super) fn piece_ranges(len: usize, pieces: usize) -> impl Iterator<Item = (usize, usize)> {
    let pieces = pieces.clamp(1, len.max(1));
    (0..pieces).map(move |j| (j * len / pieces, (j + 1) * len / pieces - j * len / pieces))
}
