//! `symm_lc_allgather`: the ranks' inputs concatenated along dimension 0
//! in rank order, as PyTorch's `_low_contention_all_gather`. Two paths,
//! chosen by `decide::decide_lc_allgather` from agreed facts only (the
//! bytes per rank, the world, whether the backend has the device-side
//! all-gather and every rank a device of its own), and put in the
//! signature:
//!
//! - **copy engines** (large messages): pure copies, each rank pulling
//!   from one peer at a time (its own input first, then the others in
//!   turn), so that on GPUs the copy engines move the data, no SM is
//!   taken from concurrent compute, and no two ranks read one peer at
//!   once. The low-contention design; it costs two barriers and a copy
//!   launch per peer, ~25 us before any byte moves.
//! - **lines** (small messages, below a few MiB per rank where the cost
//!   model, `cost::lc_allgather`, predicts it faster): one launch of the
//!   device-side all-gather (`Backend::all_gather`), the one-shot
//!   all-reduce's LL lines placed instead of summed, through the group's
//!   all-reduce buffer; no barrier, a few us. It uses SMs, but for the
//!   microseconds a small message takes, contention does not matter, and
//!   latency does. Any dtype: a copy of bytes. A rank whose input or
//!   output is strided packs (unpacks) it through the workspace around the
//!   launch; every rank lays out room for that, so that whether a rank
//!   packs is its own business.
//!
//! Copy engines: an input that is contiguous and lies in a rendezvoused
//! symmetric buffer is read by the peers in place; otherwise its rank
//! first copies it into its workspace region. Where the input lives is
//! part of the agreed arguments: every rank's input is at the same offset
//! of the same symmetric buffer, or in ordinary memory on every rank.
//! (Peers then know where to read without an exchange per call, which copy
//! engines reading a cached call need; PyTorch's rendezvous of the tensor
//! is collective for the same reason.) Whether the input is contiguous
//! there, and so read in place, is agreed too: ranks whose symmetric inputs
//! differ in that fail with `Mismatch` (a fact allowed to differ could
//! change on one rank while another repeats a call whose agreement it
//! keeps). Barriers before and
//! after the pulls keep a rank from reading an input before its owner
//! wrote it, or after its owner returned and may overwrite it.

use super::agree::Signature;
use super::decide::{decide_lc_allgather, Facts, GatherPath};
use super::symmetric::{Placed, SymmetricPlace};
use super::workspace::Layout;
use super::{check, shape_text, Exec, Prepared};
use crate::array::Array;
use crate::backend::{AllReduceLayout, Stream};
use crate::error::{err, Result};
use crate::group::Group;
use std::sync::Arc;

/// One rank's call, as read from the caller.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LcAllgather {
    pub input: Array,
    pub output: Array,
}

/// Collective over `group`: see the module documentation. `call` is `Err`
/// when the caller's arguments could not be read; this rank still takes
/// part in the agreement so its peers fail too.
pub fn lc_allgather(group: &Arc<Group>, call: Result<LcAllgather>, stream: Stream) -> Result<()> {
    lc_allgather_by(group, call, stream, None)
}

/// [`lc_allgather`] by `path` (`None`: the decision's), for tests of
/// either path on any backend that has it.
pub(crate) fn lc_allgather_by(
    group: &Arc<Group>,
    call: Result<LcAllgather>,
    stream: Stream,
    path: Option<GatherPath>,
) -> Result<()> {
    if !group.topology().single_host() {
        return super::across_hosts::lc_allgather(group, call, stream);
    }
    let facts = Facts::of(group);
    // A contiguous input in symmetric memory is read in place (copy
    // engines), on every rank alike: where it lies is agreed.
    let (placed, symmetric) = Placed::of(group, call, |c| &c.input);
    let prepare = |Placed { call: c, .. }: Placed<LcAllgather>| {
        let bytes = c.input.numel().saturating_mul(c.input.dtype.size());
        let decision = decide_lc_allgather(&facts, bytes, path);
        let sig = c.signature(symmetric.as_ref()).arg("path", decision.as_ref().map_or("undecided", |d| d.path.name()));
        (sig, decision.and_then(|d| c.prepare(facts.world, symmetric, d.path)))
    };
    match path {
        // A call made again reuses its preparation (`memo`).
        None => super::run_prepared(group, stream, placed, prepare),
        Some(_) => super::run(group, stream, placed.map(prepare)),
    }
}

impl LcAllgather {
    pub(super) fn signature(&self, symmetric: Option<&SymmetricPlace>) -> Signature {
        Signature::new("lc_allgather")
            .arg("input.dtype", self.input.dtype)
            .arg("input.shape", shape_text(&self.input.shape))
            .arg("input memory", SymmetricPlace::describe(symmetric))
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

    fn prepare(self, world: usize, symmetric: Option<SymmetricPlace>, path: GatherPath) -> Result<LcPrepared> {
        let staged_bytes = self.check(world)?;
        let gathered_bytes = check::mul(staged_bytes, world, "the gathered input")?;
        let in_place = symmetric.is_some();
        let mut p = LcPrepared {
            call: self,
            path,
            symmetric,
            in_place,
            world,
            staged_bytes,
            gathered_bytes,
            staged: 0,
            packed: None,
            workspace: 0,
        };
        p.lay_out();
        Ok(p)
    }
}

/// Own parts at least this large are copied on the side stream.
const SIDE_COPY_BYTES: usize = 4 << 20;

struct LcPrepared {
    call: LcAllgather,
    path: GatherPath,
    /// Where every rank's input lies in symmetric memory, if it does.
    symmetric: Option<SymmetricPlace>,
    /// Whether every rank's input is read in place there (agreed).
    in_place: bool,
    world: usize,
    staged_bytes: usize,
    /// `world` inputs.
    gathered_bytes: usize,
    /// Copy engines: workspace offset of the staged input of the other ranks.
    staged: usize,
    /// Lines: workspace offsets of the packed input and output, when a
    /// rank's are strided.
    packed: Option<(usize, usize)>,
    workspace: usize,
}

impl LcPrepared {
    /// Workspace, from agreed facts only, so every rank sizes it alike.
    /// Copy engines: the staged input, unless every rank's is read in
    /// place (then the workspace only carries the barriers). Lines: room to
    /// pack this rank's input and output (whether a rank's are strided is
    /// its own business: the small messages the lines take make the room
    /// cheaper than exchanging that fact, which would cost every call its
    /// cached agreement).
    fn lay_out(&mut self) {
        let mut layout = Layout::default();
        (self.staged, self.packed) = match self.path {
            GatherPath::CopyEngines if self.in_place => (0, None),
            GatherPath::CopyEngines => (layout.region(self.staged_bytes), None),
            GatherPath::Lines => (0, Some((layout.region(self.staged_bytes), layout.region(self.gathered_bytes)))),
        };
        self.workspace = layout.bytes();
    }

    /// The lines path: one device-side all-gather between contiguous
    /// arrays, this rank's strided input packed before it and its output
    /// unpacked after it.
    fn lines(&self, ex: &Exec<'_>) -> Result<()> {
        let LcAllgather { input, output } = &self.call;
        if self.staged_bytes == 0 {
            return Ok(());
        }
        let packed = |pick: fn((usize, usize)) -> usize| {
            let region = self.packed.ok_or_else(|| err!(Internal, "a strided lc_allgather has no packing region"))?;
            Ok::<u64, crate::error::Error>(ex.local(pick(region)))
        };
        let src = match input.is_contiguous() {
            true => input.addr,
            false => {
                let at = packed(|(i, _)| i)?;
                ex.copy(&Array::contiguous(at, input.dtype, &input.shape), input)?;
                at
            }
        };
        let dst = match output.is_contiguous() {
            true => output.addr,
            false => packed(|(_, o)| o)?,
        };
        ex.all_gather_lines(src, dst, self.staged_bytes)?;
        if !output.is_contiguous() {
            ex.copy(output, &Array::contiguous(dst, output.dtype, &output.shape))?;
        }
        Ok(())
    }
}

impl Prepared for LcPrepared {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    fn all_reduce_bytes(&self) -> usize {
        match self.path {
            GatherPath::Lines => AllReduceLayout::bytes_for(self.staged_bytes, self.world),
            GatherPath::CopyEngines => 0,
        }
    }

    fn replay_key(&self) -> String {
        format!(
            "{:?} by {:?} in place {:?} on ranks {:?} staged {} packed {:?}",
            self.call, self.path, self.symmetric, self.in_place, self.staged, self.packed
        )
    }

    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        if self.path == GatherPath::Lines {
            return self.lines(ex);
        }
        let LcAllgather { input, output } = &self.call;
        let source = |r: usize| -> Result<Array> {
            let addr = match &self.symmetric {
                Some(place) if self.in_place => place.on(r)?,
                _ => ex.at(r, self.staged)?,
            };
            Ok(Array::contiguous(addr, input.dtype, &input.shape))
        };
        let (me, len) = (ex.rank(), input.shape[0]);
        let own = output.narrow(0, me * len, len);
        // This rank's part comes straight from its input, or from its staged
        // copy where neither side is contiguous (no one copy maps, say, a
        // transposed input onto padded rows); a large one goes on the side
        // stream, beside the staging copy and the pulls (a small one is not
        // worth the two extra driver calls of the fork).
        let direct = input.is_contiguous() || own.is_contiguous();
        let stage = !self.in_place;
        if stage && !direct {
            ex.copy(&source(me)?, input)?;
        }
        let from = if direct { input.clone() } else { source(me)? };
        let side = if own.numel() * own.dtype.size() >= SIDE_COPY_BYTES { Some(ex.side()?) } else { None };
        match side {
            Some(side) => {
                ex.fork(side)?;
                ex.copy_on(side, &own, &from)?;
            }
            None => ex.copy(&own, &from)?,
        }
        if stage && direct {
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
mod gpu;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::DType;
    use crate::buffer::{rendezvous, Buffer};
    use crate::error::ErrorKind;
    use crate::ops::testing::{host_groups, lines_calls, on_each};

    #[test]
    fn output_must_hold_every_rank() {
        let call = |out: &[usize]| LcAllgather {
            input: Array::contiguous(0x100_0000, DType::F8E5M2, &[2, 3]),
            output: Array::contiguous(0x200_0000, DType::F8E5M2, out),
        };
        let e = call(&[4, 3]).prepare(3, None, GatherPath::CopyEngines).err().unwrap();
        assert_eq!(e.msg, "output.shape is [4, 3]; expected [6, 3]");
        let e = call(&[4, 3]).prepare(3, None, GatherPath::Lines).err().unwrap();
        assert_eq!(e.msg, "output.shape is [4, 3]; expected [6, 3]");
        assert_eq!(call(&[6, 3]).prepare(3, None, GatherPath::CopyEngines).ok().unwrap().workspace, 6);
        // The lines: room to pack the input (6 bytes) and output (18).
        let p = call(&[6, 3]).prepare(3, None, GatherPath::Lines).ok().unwrap();
        assert_eq!((p.workspace >= 24, p.all_reduce_bytes()), (true, AllReduceLayout::bytes_for(6, 3)));
    }

    /// 3 MiB per rank gathered by the copy engines from symmetric memory
    /// needs no more than the smallest workspace; from ordinary memory it is
    /// staged in a larger one.
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
            let copies = Some(GatherPath::CopyEngines);
            lc_allgather_by(g, Ok(LcAllgather { input, output: output.clone() }), Stream(0), copies).unwrap();
            check(&out);
            let in_place =
                crate::ops::state::of(g).scratch(crate::ops::state::Scratch::Workspace).unwrap().buffer().size();

            out.fill(0);
            let mut ordinary: Vec<u32> = (0..n).map(|i| value(r, i)).collect();
            let input = Array::contiguous(ordinary.as_mut_ptr() as u64, DType::F32, &[n]);
            lc_allgather_by(g, Ok(LcAllgather { input, output }), Stream(0), copies).unwrap();
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

    /// Byte `i` of rank `r`'s input in call `c`: never the poison.
    fn byte(r: usize, c: usize, i: usize) -> u8 {
        match (i * 7 + (i >> 8) * 13 + r * 31 + c * 101) as u8 ^ 0xa5 {
            POISON => !POISON,
            b => b,
        }
    }

    const POISON: u8 = 0x5a;

    /// Where a case's input and output lie.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Place {
        Contiguous,
        /// Input transposed (column-major), output rows padded by one
        /// element (a poisoned gap).
        Strided,
        /// Input in a rendezvoused buffer (read in place by the copy engines).
        Symmetric,
    }

    /// One rank's gather of a `[rows, cols]` `dtype` input placed as
    /// `place`, by `path`, into a poisoned output: every byte of the output
    /// buffer checked (the gathered ones, and the poison of the gaps and
    /// past the end). Collective.
    fn gather_case(
        g: &Arc<Group>,
        path: GatherPath,
        (dtype, rows, cols): (DType, usize, usize),
        place: Place,
        call_no: usize,
    ) {
        let (r, world, e) = (g.rank(), g.world(), dtype.size());
        let what = format!("world {world} rank {r} {path:?} {dtype} [{rows}, {cols}] {place:?} call {call_no}");
        let n = rows * cols;
        let transposed = place == Place::Strided;
        let at = |i: usize, j: usize| if transposed { i + j * rows } else { i * cols + j };
        let sym = (place == Place::Symmetric).then(|| {
            let b = Buffer::create(g, n * e).unwrap();
            let h = rendezvous(&b).unwrap();
            (b, h)
        });
        let mut ordinary = vec![0u8; n * e];
        let base = sym.as_ref().map_or(ordinary.as_mut_ptr() as u64, |(b, _)| b.addr());
        // SAFETY: either buffer holds n * e bytes.
        let mem = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, n * e) };
        for (i, j) in (0..rows).flat_map(|i| (0..cols).map(move |j| (i, j))) {
            for b in 0..e {
                mem[at(i, j) * e + b] = byte(r, call_no, (i * cols + j) * e + b);
            }
        }
        let strides = if transposed { vec![1, rows] } else { vec![cols, 1] };
        let input = Array { addr: base, dtype, shape: vec![rows, cols], strides };
        let ld = if transposed { cols + 1 } else { cols };
        let mut out = vec![POISON; world * rows * ld * e + 16];
        let output =
            Array { addr: out.as_mut_ptr() as u64, dtype, shape: vec![world * rows, cols], strides: vec![ld, 1] };
        lc_allgather_by(g, Ok(LcAllgather { input, output }), Stream(0), Some(path))
            .unwrap_or_else(|err| panic!("{what}: {}", err.msg));
        let mut want = vec![POISON; out.len()];
        for (row, j) in (0..world * rows).flat_map(|row| (0..cols).map(move |j| (row, j))) {
            let (q, i) = (row / rows, row % rows);
            for b in 0..e {
                want[(row * ld + j) * e + b] = byte(q, call_no, (i * cols + j) * e + b);
            }
        }
        if let Some(k) = (0..out.len()).find(|&k| out[k] != want[k]) {
            panic!("{what}: byte {k} of the output is {:#x}, expected {:#x}", out[k], want[k]);
        }
        drop(sym);
    }

    /// Both paths, forced, at worlds 1 to 4: every dtype, sizes from 2
    /// bytes to 125 KiB with odd byte counts and tails shorter than a line
    /// (3 bf16, 5 int8, 63 fp8), contiguous, strided and symmetric, each
    /// twice (new values; the lines' call parity) into poisoned outputs.
    /// The lines number every call in the all-reduce buffer (its count),
    /// the copy engines make no such buffer.
    #[test]
    fn both_paths_gather_every_dtype_and_size_at_worlds_1_to_4() {
        // The largest first: the all-reduce buffer is sized once, so its
        // count is every lines call's.
        let cases = [
            (DType::BF16, 64, 1000),
            (DType::BF16, 3, 1),
            (DType::I8, 5, 1),
            (DType::U8, 1001, 1),
            (DType::F16, 1, 1),
            (DType::F32, 4, 5),
            (DType::I32, 7, 3),
            (DType::I64, 3, 5),
            (DType::F8E4M3, 9, 7),
            (DType::F8E5M2, 2, 3),
        ];
        let places = [Place::Contiguous, Place::Strided, Place::Symmetric];
        for world in 1..=4 {
            let groups = host_groups(world);
            on_each(&groups, |_, g| {
                for path in [GatherPath::CopyEngines, GatherPath::Lines] {
                    for case in cases {
                        for place in places {
                            (0..2).for_each(|call_no| gather_case(g, path, case, place, call_no));
                        }
                    }
                    let calls = lines_calls(g);
                    match path {
                        GatherPath::CopyEngines => assert_eq!(calls, None, "world {world}"),
                        GatherPath::Lines => {
                            assert_eq!(calls, Some((cases.len() * places.len() * 2) as u32), "world {world}")
                        }
                    }
                }
            });
            groups.iter().for_each(|g| g.release_scratch());
        }
    }

    /// Unforced, the host's ranks (threads of their own, so free to wait
    /// for each other) take the lines for a small message; ranks forcing
    /// different paths fail
    /// together (Mismatch) instead of waiting for each other (the call was
    /// agreed before: checked on every call here).
    #[test]
    fn host_ranks_take_the_lines_when_small_and_paths_must_agree() {
        let groups = Group::new_local(&[0, 0], &crate::ops::testing::host_config(true)).unwrap();
        let errs = on_each(&groups, |r, g| {
            let mut input = vec![7u8; 8];
            let mut out = vec![0u8; 16];
            let (input, out) = (input.as_mut_ptr() as u64, out.as_mut_ptr() as u64);
            let call = || LcAllgather {
                input: Array::contiguous(input, DType::U8, &[8]),
                output: Array::contiguous(out, DType::U8, &[16]),
            };
            lc_allgather(g, Ok(call()), Stream(0)).unwrap();
            assert_eq!(lines_calls(g), Some(1));
            let path = if r == 0 { GatherPath::Lines } else { GatherPath::CopyEngines };
            lc_allgather_by(g, Ok(call()), Stream(0), Some(path)).unwrap_err()
        });
        for e in errs {
            assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "{}", e.msg);
            assert!(e.msg.contains("path"), "{}", e.msg);
        }
        groups.iter().for_each(|g| g.release_scratch());
    }

    /// Inputs at the same offset of one symmetric buffer, with strides that
    /// differ per rank (the header allows it): agreed, not a mismatch; the
    /// contiguous rank is read in place, the strided one is staged.
    #[test]
    fn symmetric_inputs_agree_on_being_read_in_place() {
        let groups = host_groups(2);
        let outs = on_each(&groups, |r, g| {
            let buf = Buffer::create(g, 4 * 6).unwrap();
            let h = rendezvous(&buf).unwrap();
            // SAFETY: the buffer holds 6 f32.
            let mem = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut f32, 6) };
            let mut out = vec![-1f32; 12];
            let output = Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &[4, 3]);
            let mut got = Vec::new();
            // Logical [2, 3] of value 10 * rank + (row * 3 + col), row-major
            // or column-major (strides [1, 2]): row-major on rank 0 only,
            // twice: a mismatch on both ranks each time, nothing written;
            // then column-major on every rank, row-major on every rank,
            // column-major again (each read where it lies or staged, as
            // agreed, the last call's agreement kept from the first).
            for (call, column_major) in [(0, [false, true]), (1, [true, true]), (2, [false, false]), (3, [true, true])]
            {
                let strides = if column_major[r] { vec![1, 2] } else { vec![3, 1] };
                for (i, j) in (0..2).flat_map(|i| (0..3).map(move |j| (i, j))) {
                    mem[i * strides[0] + j * strides[1]] = (10 * r + i * 3 + j) as f32;
                }
                let input = Array { addr: buf.addr(), dtype: DType::F32, shape: vec![2, 3], strides };
                for _ in 0..1 + usize::from(call == 0) {
                    out.fill(-1.0);
                    let res =
                        lc_allgather(g, Ok(LcAllgather { input: input.clone(), output: output.clone() }), Stream(0));
                    got.push((res.map_err(|e| e.kind), out.clone()));
                }
            }
            drop(h);
            got
        });
        let want: Vec<f32> = (0..12).map(|i| (10 * (i / 6) + i % 6) as f32).collect();
        for got in outs {
            let (results, values): (Vec<_>, Vec<_>) = got.into_iter().unzip();
            assert_eq!(results, [Err(ErrorKind::Mismatch), Err(ErrorKind::Mismatch), Ok(()), Ok(()), Ok(())]);
            assert_eq!(values, [vec![-1.0; 12], vec![-1.0; 12], want.clone(), want.clone(), want.clone()]);
        }
        groups.iter().for_each(|g| g.release_scratch());
    }
}
