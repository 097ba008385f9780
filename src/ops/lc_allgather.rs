//! `symm_lc_allgather`: the ranks' inputs concatenated along dimension 0
//! in rank order, as PyTorch's `_low_contention_all_gather`: pure copies,
//! each rank pulling from one peer at a time (its own input first, then
//! the others in turn), so that on GPUs the copy engines move the data and
//! no two ranks read one peer at once.
//!
//! An input that is contiguous and lies in a rendezvoused symmetric buffer
//! is read by the peers in place; otherwise every rank first copies its
//! input into its workspace region. Where the input lives is part of the
//! agreed arguments: every rank's input is at the same offset of the same
//! symmetric buffer, or in ordinary memory on every rank. (Peers then know
//! where to read without an exchange per call, which copy engines reading
//! a cached call need; PyTorch's rendezvous of the tensor is collective
//! for the same reason.) Barriers before and after the pulls keep a rank
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
    let world = group.world();
    let prepared = call.map(|c| {
        // A symmetric input is read in place from every rank.
        let symmetric = SymmetricPlace::of(group, &c.input);
        (c.signature(symmetric.as_ref()), c.prepare(world, symmetric))
    });
    super::run(group, stream, prepared)
}

impl LcAllgather {
    fn signature(&self, symmetric: Option<&SymmetricPlace>) -> Signature {
        Signature::new("lc_allgather")
            .arg("input.dtype", self.input.dtype)
            .arg("input.shape", shape_text(&self.input.shape))
            .arg("input memory", SymmetricPlace::describe(symmetric))
    }

    fn prepare(self, world: usize, symmetric: Option<SymmetricPlace>) -> Result<LcPrepared> {
        let (input, output) = (&self.input, &self.output);
        check::same_dtype(output, "output", input.dtype, "input")?;
        let mut want = input.shape.clone();
        want[0] = check::mul(want[0], world, "the gathered input")?;
        check::shape_is(output, "output", &want)?;
        check::outputs_disjoint(&[("output".into(), output)], &[("input".into(), input)])?;
        // Workspace: the staged input, unless it is read in place (then the
        // workspace only carries the barriers).
        let mut layout = Layout::default();
        let staged = match symmetric {
            Some(_) => 0,
            None => layout.region(check::mul(input.numel(), input.dtype.size(), "input")?),
        };
        Ok(LcPrepared { call: self, symmetric, staged, workspace: layout.bytes() })
    }
}

/// Own parts at least this large are copied on the side stream.
const SIDE_COPY_BYTES: usize = 4 << 20;

struct LcPrepared {
    call: LcAllgather,
    /// Where every rank's input is read in place, if it is.
    symmetric: Option<SymmetricPlace>,
    /// Workspace offset of the staged input otherwise.
    staged: usize,
    workspace: usize,
}

impl Prepared for LcPrepared {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    fn replay_key(&self) -> String {
        format!("{:?} in place {:?} staged {}", self.call, self.symmetric, self.staged)
    }

    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        let LcAllgather { input, output } = &self.call;
        let in_place = self.symmetric.as_ref();
        let source = |r: usize| -> Result<Array> {
            let addr = match in_place {
                Some(place) => place.on(r)?,
                None => ex.at(r, self.staged)?,
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
        if in_place.is_none() {
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
}
