//! `symm_fused_ag_mm`: `all_gather(a_shard, gather_dim) @ bs[i]` for one or
//! more B sharing one gathered A, as PyTorch's `fused_all_gather_matmul`.
//!
//! The gathered A is the ranks' shards concatenated along `gather_dim` in
//! rank order; output i is gathered A @ `bs[i]`, the gathered shape with the
//! last dimension N_i. Gathering the last dimension concatenates K: each
//! B then has K * world rows, and output i is the sum over ranks r of
//! `shard_r @ bs[i][r*K .. (r+1)*K]`.
//!
//! Execution (see `AgMmPlan::execute`): every rank copies its shard,
//! contiguous, into its workspace; after a barrier it pulls every peer's
//! shard into its own workspace and copies each to its slice of `ag_out`.
//! For gather_dim < last, shard r times B is slice r of each output, written
//! directly when that slice is a matrix, else through scratch. For the last
//! dimension the shards are laid side by side into one matrix and multiplied
//! once over the whole K.

use super::agree::Signature;
use super::workspace::Layout;
use super::{check, fused, shape_text, Exec, Plan};
use crate::array::Array;
use crate::backend::{FusedGather, FusedMatmul, Stream};
use crate::error::{err, Result};
use crate::group::Group;
use crate::plan;
use std::sync::Arc;

/// One rank's call, as read from the caller.
#[derive(Clone, Debug)]
pub struct AgMm {
    pub a_shard: Array,
    pub bs: Vec<Array>,
    pub gather_dim: i64,
    pub ag_out: Option<Array>,
    pub outs: Vec<Array>,
    /// Options of a later version that the caller set (named as in C).
    pub later_options: Vec<&'static str>,
}

/// Collective over `group`: see the module documentation. `call` is `Err`
/// when the caller's arguments could not be read; this rank still takes
/// part in the agreement so its peers fail too.
pub fn fused_ag_mm(group: &Arc<Group>, call: Result<AgMm>, stream: Stream) -> Result<()> {
    let world = group.world();
    let backend = group.backend().kind().name();
    super::run(
        group,
        stream,
        call.map(|c| {
            let fused = c.fused_field(group);
            (c.signature(fused.as_ref()), c.plan(world, backend, fused::chosen(fused.as_ref())))
        }),
    )
}

impl AgMm {
    fn signature(&self, fused: Option<&String>) -> Signature {
        let a = &self.a_shard;
        let mut s = Signature::new("fused_ag_mm")
            .arg("a_shard.dtype", a.dtype)
            .arg("a_shard.shape", shape_text(&a.shape))
            .arg("gather_dim", self.gather_dim)
            .arg("num_b", self.bs.len());
        for (i, b) in self.bs.iter().enumerate() {
            s = s.arg(format!("bs[{i}].shape"), shape_text(&b.shape));
        }
        match fused {
            Some(f) => s.arg("fused", f),
            None => s,
        }
    }

    /// Whether this rank's call suits the fused kernel (see `fused::field`):
    /// gathering dim 0 into matrices.
    fn fused_field(&self, group: &Group) -> Option<String> {
        let a = &self.a_shard;
        let k = *a.shape.last()?;
        fused::field(group, a.dtype, k, || {
            if self.gather_dim != 0 || self.bs.len() != self.outs.len() {
                return None;
            }
            let lhs = a.as_matrix()?;
            let rows = lhs.shape[0];
            self.bs
                .iter()
                .zip(&self.outs)
                .map(|(b, o)| Some(fused::prototype(lhs.clone(), b.clone(), o.as_matrix()?, rows, group.world())))
                .collect()
        })
    }

    fn plan(self, world: usize, backend: &str, fused: bool) -> Result<AgMmPlan> {
        let a = &self.a_shard;
        check::matmul_dtype(a, "a_shard", backend)?;
        check::ndim_at_least(a, "a_shard", 2)?;
        let dim = check::dim(self.gather_dim, "gather_dim", a.ndim(), "a_shard")?;
        check::no_later_options(&self.later_options, backend)?;
        let last = a.ndim() - 1;
        let mut gathered = a.shape.clone();
        gathered[dim] = check::mul(a.shape[dim], world, "the gathered a_shard")?;
        let k_total = gathered[last];
        for (i, b) in self.bs.iter().enumerate() {
            let name = format!("bs[{i}]");
            check::same_dtype(b, &name, a.dtype, "a_shard")?;
            check::ndim_is(b, &name, 2)?;
            if b.shape[0] != k_total {
                let why = if dim == last {
                    format!("a_shard's last dimension {} times the world size {world}", a.shape[last])
                } else {
                    "a_shard's last dimension".to_string()
                };
                return Err(err!(InvalidArgument, "{name}.shape[0] is {}; expected {k_total}, {why}", b.shape[0]));
            }
        }
        if let Some(ag) = &self.ag_out {
            check::same_dtype(ag, "ag_out", a.dtype, "a_shard")?;
            check::shape_is(ag, "ag_out", &gathered)?;
        }
        for (i, (o, b)) in self.outs.iter().zip(&self.bs).enumerate() {
            let name = format!("outs[{i}]");
            check::output_dtype(o, &name, a.dtype, backend)?;
            let mut want = gathered[..last].to_vec();
            want.push(b.shape[1]);
            check::shape_is(o, &name, &want)?;
        }
        let outputs: Vec<(String, &Array)> = self
            .ag_out
            .iter()
            .map(|t| ("ag_out".to_string(), t))
            .chain(self.outs.iter().enumerate().map(|(i, t)| (format!("outs[{i}]"), t)))
            .collect();
        let inputs: Vec<(String, &Array)> = std::iter::once(("a_shard".to_string(), a))
            .chain(self.bs.iter().enumerate().map(|(i, t)| (format!("bs[{i}]"), t)))
            .collect();
        check::outputs_disjoint(&outputs, &inputs)?;

        // Workspace: every rank's shard back to back (this rank's own at its
        // rank's place, the others pulled there), so that for gather_dim 0
        // they form the gathered A; when gathering K, the gathered A laid
        // out as one matrix; then scratch for one product in the output
        // dtype (the gathered rows x the widest N). From agreed shapes only.
        let rows = a.numel() / a.shape[last];
        let max_n = self.bs.iter().map(|b| b.shape[1]).max().unwrap_or(0);
        let shard_bytes = check::mul(a.numel(), a.dtype.size(), "a_shard")?;
        let mut layout = Layout::default();
        let shards = layout.region(check::mul(shard_bytes, world, "the gathered a_shard")?);
        let gathered_k = if dim == last {
            Some(layout.region(check::mul(shard_bytes, world, "the gathered a_shard")?))
        } else {
            None
        };
        let scratch =
            layout.region(check::mul(check::mul(rows, max_n, "the product")?, a.dtype.size(), "the product")?);
        // The fused kernel's arrival flags, one u32 per rank.
        let ready = layout.region(4 * world);
        let problem = plan::Problem {
            m: rows * world,
            k: a.shape[last],
            n: self.bs.iter().map(|b| b.shape[1]).sum(),
            world,
            elem_bytes: a.dtype.size(),
            fused,
        };
        let algorithm = plan::choose(&plan::ag_mm(&problem, &plan::DeviceModel::HOPPER))?;
        Ok(AgMmPlan {
            call: self,
            dim,
            shards,
            shard_bytes,
            gathered_k,
            scratch,
            ready,
            algorithm,
            workspace: layout.bytes(),
        })
    }
}

#[derive(Debug)]
struct AgMmPlan {
    call: AgMm,
    dim: usize,
    /// Workspace offsets: rank r's shard at `shards + r * shard_bytes`.
    shards: usize,
    shard_bytes: usize,
    /// The gathered A as one `[rows, K * world]` matrix, when gathering K.
    gathered_k: Option<usize>,
    scratch: usize,
    /// The fused kernel's arrival flags.
    ready: usize,
    algorithm: plan::Algorithm,
    workspace: usize,
}

impl Plan for AgMmPlan {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    /// This rank's shard goes to its place in its workspace; a side stream
    /// waits for every rank to be there, then pulls the peers' shards into
    /// this rank's workspace (copy engines on CUDA), rank-1 first. Pipelined:
    /// the main stream multiplies this rank's shard at once and each pulled
    /// shard as it lands. Sequential: one matmul over the gathered A once
    /// everything has landed (cuBLAS runs one large matmul faster than
    /// pieces, which pays when the pulls are short).
    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        if self.algorithm == plan::Algorithm::Fused {
            return self.fused(ex);
        }
        let AgMm { a_shard: a, bs, ag_out, outs, .. } = &self.call;
        let (dim, len, me, world) = (self.dim, a.shape[self.dim], ex.rank(), ex.world());
        let offset = |r: usize| self.shards + r * self.shard_bytes;
        let local_shard = |r: usize| Array::contiguous(ex.local(offset(r)), a.dtype, &a.shape);
        ex.copy(&local_shard(me), a)?;
        let side = ex.side()?;
        ex.fork(side)?;
        ex.ws.barrier(super::CHANNEL, side)?;
        let gathers_k = dim == a.ndim() - 1;
        let gathered = self.gathered_matrix(ex);
        let whole = self.algorithm == plan::Algorithm::Sequential && !gathers_k && gathered.is_some();
        let pipelined = !gathers_k && !whole;
        if pipelined {
            self.multiply_shard(ex, &local_shard(me), me, len)?;
        }
        for step in 1..world {
            let r = (me + world - step) % world;
            let remote = Array::contiguous(ex.at(r, offset(r))?, a.dtype, &a.shape);
            ex.copy_on(side, &local_shard(r), &remote)?;
            if pipelined {
                ex.join(side)?;
                self.multiply_shard(ex, &local_shard(r), r, len)?;
            }
        }
        // The pulls have landed once the main stream joins the side here;
        // the closing barrier (every rank has pulled this rank's shard, so
        // the next call may overwrite it) then overlaps the matmuls below.
        ex.join(side)?;
        ex.ws.barrier(super::CHANNEL, side)?;
        if let Some(ag) = ag_out {
            for r in 0..world {
                ex.copy(&ag.narrow(dim, r * len, len), &local_shard(r))?;
            }
        }
        if whole {
            let lhs = gathered.expect("checked above");
            for (b, out) in bs.iter().zip(outs) {
                let m = out.as_matrix().expect("checked by gathered_matrix");
                ex.gemm(&m, &lhs, b, false)?;
            }
        }
        if let Some(offset) = self.gathered_k {
            // Lay the shards side by side (pitched copies), then one matmul
            // over the whole K per B.
            let mut shape = a.shape.clone();
            shape[dim] *= world;
            let gathered = Array::contiguous(ex.local(offset), a.dtype, &shape);
            for r in 0..world {
                ex.copy(&gathered.narrow(dim, r * len, len), &local_shard(r))?;
            }
            let lhs = gathered.as_matrix().expect("a contiguous array is a matrix");
            for (b, out) in bs.iter().zip(outs) {
                self.gemm_into(ex, out, &lhs, b)?;
            }
        }
        ex.join(side)
    }
}

impl AgMmPlan {
    /// Fused (gathering dim 0 into matrices, see `fused_field`): the main
    /// stream zeroes the arrival flags, stages this rank's shard for the
    /// peers, and launches one matmul per B, which starts with this rank's
    /// own rows read in place. A side stream forked before the matmuls (so
    /// it never waits for them) waits for every rank (barrier), pulls the
    /// peers' shards rank+1 first, each followed by its flag, and waits for
    /// every rank again (then nobody still reads a shard the next call
    /// overwrites). One multiprocessor is left to the side stream's barrier
    /// kernels.
    fn fused(&self, ex: &Exec<'_>) -> Result<()> {
        let AgMm { a_shard: a, bs, ag_out, outs, .. } = &self.call;
        let (len, me, world) = (a.shape[0], ex.rank(), ex.world());
        let backend = ex.group.backend();
        let offset = |r: usize| self.shards + r * self.shard_bytes;
        let local_shard = |r: usize| Array::contiguous(ex.local(offset(r)), a.dtype, &a.shape);
        backend.zero(ex.local(self.ready), 4 * world, ex.stream)?;
        // Staged for the peers on the main stream, before the matmul: a copy
        // within one device runs on the SMs (measured: on the side stream,
        // beside a persistent kernel that leaves it one SM, it made the
        // whole operation 9-12x slower).
        ex.copy(&local_shard(me), a)?;
        let side = ex.side()?;
        ex.fork(side)?;
        // The matmuls are enqueued first, so they start while the host is
        // still issuing the side stream's work.
        let lhs = a.as_matrix().expect("checked by fused_field");
        let rows = lhs.shape[0];
        let gathered = Array::contiguous(ex.local(self.shards), a.dtype, &[rows * world, lhs.shape[1]]);
        for (b, out) in bs.iter().zip(outs) {
            let call = FusedMatmul {
                gather: Some(FusedGather { ready: ex.local(self.ready), local_chunk: me, local: lhs.clone() }),
                order: (0..world).map(|i| (me + i) % world).collect(),
                spare_sms: 1,
                timeout: ex.group.timeout(),
                ..fused::prototype(gathered.clone(), b.clone(), out.as_matrix().expect("checked"), rows, world)
            };
            backend.fused_matmul(&call, ex.stream)?;
        }
        ex.ws.barrier(super::CHANNEL, side)?;
        for step in 1..world {
            let r = (me + step) % world;
            let remote = Array::contiguous(ex.at(r, offset(r))?, a.dtype, &a.shape);
            ex.copy_on(side, &local_shard(r), &remote)?;
            ex.ws.write_value(me, self.ready + 4 * r, 1, side)?;
        }
        ex.ws.barrier(super::CHANNEL, side)?;
        ex.join(side)?;
        if let Some(ag) = ag_out {
            for r in 0..world {
                ex.copy(&ag.narrow(0, r * len, len), &local_shard(r))?;
            }
        }
        Ok(())
    }

    /// The gathered A as one matrix in this rank's workspace, when it is one
    /// (gathering dim 0) and every output is a matrix too.
    fn gathered_matrix(&self, ex: &Exec<'_>) -> Option<Array> {
        let a = &self.call.a_shard;
        if self.dim != 0 || self.call.outs.iter().any(|o| o.as_matrix().is_none()) {
            return None;
        }
        let mut shape = a.shape.clone();
        shape[0] *= ex.world();
        Array::contiguous(ex.local(self.shards), a.dtype, &shape).as_matrix()
    }

    /// Shard r (local, contiguous) times every B, into slice r of each output.
    fn multiply_shard(&self, ex: &Exec<'_>, shard: &Array, r: usize, len: usize) -> Result<()> {
        let lhs = shard.as_matrix().expect("a contiguous shard is a matrix");
        for (b, out) in self.call.bs.iter().zip(&self.call.outs) {
            self.gemm_into(ex, &out.narrow(self.dim, r * len, len), &lhs, b)?;
        }
        Ok(())
    }

    /// `dst = lhs @ b`: straight into `dst` when it is a matrix, else into
    /// contiguous scratch of `dst`'s dtype and then copied (no conversion, so
    /// every backend's plain strided copy serves).
    fn gemm_into(&self, ex: &Exec<'_>, dst: &Array, lhs: &Array, b: &Array) -> Result<()> {
        match dst.as_matrix() {
            Some(m) => ex.gemm(&m, lhs, b, false),
            None => {
                let product = Array::contiguous(ex.local(self.scratch), dst.dtype, &dst.shape);
                ex.gemm(&product.as_matrix().expect("contiguous"), lhs, b, false)?;
                ex.copy(dst, &product)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::DType;
    use crate::ErrorKind;

    /// A call on fake, well-separated addresses (planning never reads them).
    fn call(shard: &[usize], dim: i64, b_rows: usize, ns: &[usize], out_lead: &[usize]) -> AgMm {
        let at = |i: u64, shape: &[usize]| Array::contiguous(0x100_0000 * (i + 1), DType::BF16, shape);
        let out_shape = |n: usize| out_lead.iter().copied().chain([n]).collect::<Vec<_>>();
        AgMm {
            a_shard: at(0, shard),
            bs: ns.iter().enumerate().map(|(i, &n)| at(1 + i as u64, &[b_rows, n])).collect(),
            gather_dim: dim,
            ag_out: None,
            outs: ns.iter().enumerate().map(|(i, &n)| at(10 + i as u64, &out_shape(n))).collect(),
            later_options: Vec::new(),
        }
    }

    #[test]
    fn gathered_shapes_for_each_dim() {
        // Leading dims: the gathered dim grows by the world size; K is kept.
        let p = call(&[2, 3, 4], 1, 4, &[5, 6], &[2, 9]).plan(3, "host", false).unwrap();
        assert_eq!(p.dim, 1);
        // Workspace: three bf16 shards of 48 bytes, then bf16 scratch of 6 rows x 6.
        assert_eq!((p.shards, p.shard_bytes, p.gathered_k, p.scratch), (0, 48, None, 256));
        // Then the fused kernel's arrival flags, one u32 per rank.
        assert_eq!((p.ready, p.workspace), (512, 512 + 3 * 4));
        // The last dim: K grows, so B has K * world rows and outputs keep the shard's rows.
        assert!(call(&[2, 3, 4], 2, 12, &[5], &[2, 3]).plan(3, "host", false).is_ok());
        let e = call(&[2, 3, 4], 2, 4, &[5], &[2, 3]).plan(3, "host", false).unwrap_err();
        assert_eq!(e.msg, "bs[0].shape[0] is 4; expected 12, a_shard's last dimension 4 times the world size 3");
        let e = call(&[2, 3, 4], 0, 4, &[5, 7], &[6, 4]).plan(3, "host", false).unwrap_err();
        assert_eq!(e.msg, "outs[0].shape is [6, 4, 5]; expected [6, 3, 5]");
    }

    #[test]
    fn ag_out_and_options() {
        let mut c = call(&[4, 8], 0, 8, &[3], &[8]);
        c.ag_out = Some(Array::contiguous(0x900_0000, DType::BF16, &[4, 8]));
        assert_eq!(c.clone().plan(2, "host", false).unwrap_err().msg, "ag_out.shape is [4, 8]; expected [8, 8]");
        c.ag_out = Some(Array::contiguous(0x900_0000, DType::BF16, &[8, 8]));
        assert!(c.clone().plan(2, "host", false).is_ok());
        c.later_options = vec!["opts->a_scale"];
        assert_eq!(c.plan(2, "host", false).unwrap_err().kind, ErrorKind::Unsupported);
    }

    #[test]
    fn signature_holds_what_ranks_must_share_only() {
        let a = call(&[4, 8], 0, 8, &[3, 5], &[8]);
        let mut b = a.clone();
        b.a_shard.strides = vec![1, 4];
        b.a_shard.addr += 0x40;
        b.outs[0].strides = vec![1, 8];
        assert_eq!(a.signature(None), b.signature(None));
        b.gather_dim = 1;
        assert_ne!(a.signature(None), b.signature(None));
    }
}
