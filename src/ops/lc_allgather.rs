//! `symm_lc_allgather`: the ranks' inputs concatenated along dimension 0
//! in rank order, as PyTorch's `_low_contention_all_gather`: pure copies,
//! each rank pulling from one peer at a time (its own input first, then
//! the others in turn), so that on GPUs the copy engines move the data and
//! no two ranks read one peer at once.
//!
//! An input that is contiguous and lies in a rendezvoused symmetric buffer
//! is read by the peers in place; otherwise its rank first copies it into
//! its workspace region. Where the input lives is part of the agreed
//! arguments: every rank's input is at the same offset of the same
//! symmetric buffer, or in ordinary memory on every rank. (Peers then know
//! where to read without an exchange per call, which copy engines reading
//! a cached call need; PyTorch's rendezvous of the tensor is collective
//! for the same reason.) Strides may differ between ranks, so whether a
//! rank's input is contiguous is a per-rank fact of the signature
//! (`Signature::local`): the peers learn it with the agreement and read
//! each rank in place or from its workspace. Barriers before and after the pulls keep a rank
//! from reading an input before its owner wrote it, or after its owner
//! returned and may overwrite it.

use super::agree::Signature;
use super::symmetric::SymmetricPlace;
use super::workspace::Layout;
use super::{check, shape_text, Exec, Prepared};
use crate::array::Array;
use crate::backend::Stream;
use crate::error::Result;
use crate::group::Group;
use std::sync::Arc;

/// One rank's call, as read from the caller.
#[derive(Clone, Debug)]
pub struct LcAllgather {
    pub input: Array,
    pub output: Array,
}

/// Collective over `group`: see the module documentation. `call` is `Err`
/// when the caller's arguments could not be read; this rank still takes
/// part in the agreement so its peers fail too.
pub fn lc_allgather(group: &Arc<Group>, call: Result<LcAllgather>, stream: Stream) -> Result<()> {
    if !group.topology().single_host() {
        return super::across_hosts::lc_allgather(group, call, stream);
    }
    let world = group.world();
    let prepared = call.map(|c| {
        // A symmetric input is read in place from every rank whose input
        // there is contiguous.
        let symmetric = SymmetricPlace::holding(group, &c.input);
        (c.signature(symmetric.as_ref()), c.prepare(world, symmetric))
    });
    super::run(group, stream, prepared)
}

/// The per-rank fact of the signature: whether this rank's input is read
/// in place.
const IN_PLACE: &str = "input read in place";

impl LcAllgather {
    pub(super) fn signature(&self, symmetric: Option<&SymmetricPlace>) -> Signature {
        Signature::new("lc_allgather")
            .arg("input.dtype", self.input.dtype)
            .arg("input.shape", shape_text(&self.input.shape))
            .arg("input memory", SymmetricPlace::describe(symmetric))
            .local(IN_PLACE, symmetric.is_some() && self.input.is_contiguous())
    }

    /// The checks of every gather, on one host or across hosts; the
    /// input's bytes.
    pub(super) fn check(&self, world: usize) -> Result<usize> {
        let (input, output) = (&self.input, &self.output);
        check::same_dtype(output, "output", input.dtype, "input")?;
        let mut want = input.shape.clone();
        want[0] = check::mul(want[0], world, "the gathered input")?;
        check::shape_is(output, "output", &want)?;
        check::outputs_disjoint(&[("output".into(), output)], &[("input".into(), input)])?;
        check::mul(input.numel(), input.dtype.size(), "input")
    }

    fn prepare(self, world: usize, symmetric: Option<SymmetricPlace>) -> Result<LcPrepared> {
        let staged_bytes = self.check(world)?;
        let in_place = vec![false; world];
        let mut p = LcPrepared { call: self, symmetric, in_place, staged_bytes, staged: 0, workspace: 0 };
        p.lay_out();
        Ok(p)
    }
}

/// Own parts at least this large are copied on the side stream.
const SIDE_COPY_BYTES: usize = 4 << 20;

struct LcPrepared {
    call: LcAllgather,
    /// Where every rank's input lies in symmetric memory, if it does.
    symmetric: Option<SymmetricPlace>,
    /// By rank: whether its input is read in place there (agreed).
    in_place: Vec<bool>,
    staged_bytes: usize,
    /// Workspace offset of the staged input of the other ranks.
    staged: usize,
    workspace: usize,
}

impl LcPrepared {
    /// Workspace: the staged input, unless every rank's is read in place
    /// (then the workspace only carries the barriers). From agreed facts
    /// only, so every rank sizes it alike.
    fn lay_out(&mut self) {
        let mut layout = Layout::default();
        self.staged = if self.in_place.iter().all(|&p| p) { 0 } else { layout.region(self.staged_bytes) };
        self.workspace = layout.bytes();
    }
}

impl Prepared for LcPrepared {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    fn agreed_by(&mut self, all: &[Signature]) {
        self.in_place = all.iter().map(|s| s.local_value(IN_PLACE) == Some("true")).collect();
        self.lay_out();
    }

    fn replay_key(&self) -> String {
        format!("{:?} in place {:?} on ranks {:?} staged {}", self.call, self.symmetric, self.in_place, self.staged)
    }

    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        let LcAllgather { input, output } = &self.call;
        let source = |r: usize| -> Result<Array> {
            let addr = match &self.symmetric {
                Some(place) if self.in_place[r] => place.on(r)?,
                _ => ex.at(r, self.staged)?,
            };
            Ok(Array::contiguous(addr, input.dtype, &input.shape))
        };
        let (me, len) = (ex.rank(), input.shape[0]);
        let own = output.narrow(0, me * len, len);
        // This rank's part comes straight from its input; a large one goes
        // on the side stream, beside the staging copy and the pulls (a
        // small one is not worth the two extra driver calls of the fork).
        let side = if own.numel() * own.dtype.size() >= SIDE_COPY_BYTES { Some(ex.side()?) } else { None };
        match side {
            Some(side) => {
                ex.fork(side)?;
                ex.copy_on(side, &own, input)?;
            }
            None => ex.copy(&own, input)?,
        }
        if !self.in_place[me] {
            ex.copy(&source(me)?, input)?;
        }
        ex.barrier()?;
        for r in ex.rotation().filter(|&r| r != me) {
            ex.copy(&output.narrow(0, r * len, len), &source(r)?)?;
        }
        ex.barrier()?;
        match side {
            Some(side) => ex.join(side),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::DType;
    use crate::buffer::{rendezvous, Buffer};
    use crate::ops::testing::{host_groups, on_each};

    #[test]
    fn output_must_hold_every_rank() {
        let call = |out: &[usize]| LcAllgather {
            input: Array::contiguous(0x100_0000, DType::F8E5M2, &[2, 3]),
            output: Array::contiguous(0x200_0000, DType::F8E5M2, out),
        };
        let e = call(&[4, 3]).prepare(3, None).err().unwrap();
        assert_eq!(e.msg, "output.shape is [4, 3]; expected [6, 3]");
        assert_eq!(call(&[6, 3]).prepare(3, None).ok().unwrap().workspace, 6);
    }

    /// 3 MiB per rank gathered from symmetric memory needs no more than the
    /// smallest workspace; from ordinary memory it is staged in a larger one.
    /// (The u32 values travel as f32 elements: same-type copies move bits.)
    #[test]
    fn symmetric_inputs_are_read_in_place() {
        let groups = host_groups(2);
        let n = 3 << 18; // u32 elements: 3 MiB per rank
        let sizes = on_each(&groups, |r, g| {
            let value = |q: usize, i: usize| (q * n + i) as u32 ^ 0x5a5a_5a5a;
            let mut out = vec![0u32; 2 * n];
            let output = Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &[2 * n]);
            let check = |out: &[u32]| assert!((0..2 * n).all(|i| out[i] == value(i / n, i % n)));

            let buf = Buffer::create(g, 4 * n).unwrap();
            let h = rendezvous(&buf).unwrap();
            // SAFETY: the buffer holds n u32s.
            let mine = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut u32, n) };
            mine.iter_mut().enumerate().for_each(|(i, v)| *v = value(r, i));
            let input = Array::contiguous(buf.addr(), DType::F32, &[n]);
            lc_allgather(g, Ok(LcAllgather { input, output: output.clone() }), Stream(0)).unwrap();
            check(&out);
            let in_place =
                crate::ops::state::of(g).scratch(crate::ops::state::Scratch::Workspace).unwrap().buffer().size();

            out.fill(0);
            let mut ordinary: Vec<u32> = (0..n).map(|i| value(r, i)).collect();
            let input = Array::contiguous(ordinary.as_mut_ptr() as u64, DType::F32, &[n]);
            lc_allgather(g, Ok(LcAllgather { input, output }), Stream(0)).unwrap();
            check(&out);
            drop(h);
            (in_place, crate::ops::state::of(g).scratch(crate::ops::state::Scratch::Workspace).unwrap().buffer().size())
        });
        for (in_place, staged) in sizes {
            assert!(in_place < 4 * n, "the in-place gather staged its input ({in_place} bytes of workspace)");
            assert!(staged >= 4 * n);
        }
        groups.iter().for_each(|g| g.release_scratch());
    }

    /// Integers gather bit-exactly at worlds 1 to 4: int64 near 2^60 and
    /// int8 (one byte per element, odd sizes), from transposed inputs, into
    /// poisoned outputs.
    #[test]
    fn integers_gather_exactly_at_worlds_1_to_4() {
        for world in 1..=4 {
            let groups = host_groups(world);
            let outs = on_each(&groups, |r, g| {
                // Logical [3, 5] stored column-major (strides [1, 3]).
                let v64 = |q: usize, i: usize| (1i64 << 60) + (q * 15 + i) as i64 * 0x1_0000_0001 - 7;
                let mut in64 = vec![0i64; 15];
                let mut in8 = vec![0i8; 15];
                for (i, j) in (0..3).flat_map(|i| (0..5).map(move |j| (i, j))) {
                    in64[i + 3 * j] = -v64(r, i * 5 + j);
                    in8[i + 3 * j] = ((r * 15 + i * 5 + j) as u8).wrapping_sub(100) as i8;
                }
                let mut out64 = vec![0x5a5a_5a5a_5a5a_5a5ai64; 15 * world];
                let mut out8 = vec![0x5ai8; 15 * world + 1];
                let strided = |addr: u64, dtype| Array { addr, dtype, shape: vec![3, 5], strides: vec![1, 3] };
                let call = LcAllgather {
                    input: strided(in64.as_mut_ptr() as u64, DType::I64),
                    output: Array::contiguous(out64.as_mut_ptr() as u64, DType::I64, &[3 * world, 5]),
                };
                lc_allgather(g, Ok(call), Stream(0)).unwrap();
                let call = LcAllgather {
                    input: strided(in8.as_mut_ptr() as u64, DType::I8),
                    output: Array::contiguous(out8.as_mut_ptr() as u64, DType::I8, &[3 * world, 5]),
                };
                lc_allgather(g, Ok(call), Stream(0)).unwrap();
                assert_eq!(out8[15 * world], 0x5a, "a byte past the output was written");
                for q in 0..world {
                    for i in 0..15 {
                        assert_eq!(out64[q * 15 + i], -v64(q, i), "world {world} rank {r} part {q} int64 {i}");
                        assert_eq!(
                            out8[q * 15 + i],
                            ((q * 15 + i) as u8).wrapping_sub(100) as i8,
                            "world {world} part {q} int8 {i}"
                        );
                    }
                }
            });
            assert_eq!(outs.len(), world);
            groups.iter().for_each(|g| g.release_scratch());
        }
    }

    /// Inputs at the same offset of one symmetric buffer, with strides that
    /// differ per rank (the header allows it): agreed, not a mismatch; the
    /// contiguous rank is read in place, the strided one is staged.
    #[test]
    fn strides_may_differ_between_ranks_in_symmetric_memory() {
        let groups = host_groups(2);
        let outs = on_each(&groups, |r, g| {
            let buf = Buffer::create(g, 4 * 6).unwrap();
            let h = rendezvous(&buf).unwrap();
            // Logical [2, 3] of value 10 * rank + (row * 3 + col): row-major
            // on rank 0, column-major (strides [1, 2]) on rank 1.
            let strides = if r == 0 { vec![3, 1] } else { vec![1, 2] };
            // SAFETY: the buffer holds 6 f32.
            let mem = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut f32, 6) };
            for (i, j) in (0..2).flat_map(|i| (0..3).map(move |j| (i, j))) {
                mem[i * strides[0] + j * strides[1]] = (10 * r + i * 3 + j) as f32;
            }
            let input = Array { addr: buf.addr(), dtype: DType::F32, shape: vec![2, 3], strides };
            let mut out = vec![0f32; 12];
            let output = Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &[4, 3]);
            for _ in 0..2 {
                // The second call reuses the agreement.
                out.fill(0.0);
                lc_allgather(g, Ok(LcAllgather { input: input.clone(), output: output.clone() }), Stream(0)).unwrap();
            }
            drop(h);
            out
        });
        let want: Vec<f32> = (0..12).map(|i| (10 * (i / 6) + i % 6) as f32).collect();
        assert_eq!(outs, vec![want.clone(), want]);
        groups.iter().for_each(|g| g.release_scratch());
    }
}
