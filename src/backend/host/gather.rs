//! The host's device-side all-gather (`Backend::all_gather`) and
//! reduce-scatter (`Backend::reduce_scatter`): the kernels' protocol
//! (kernels/allreduce.cu, `symm_ag_one_shot`, `symm_rs_one_shot_*`) on the CPU, over the
//! same buffer and layout, so that the operations' LL path runs and is
//! tested on the host. The call count in the buffer's header numbers the
//! call (`seq`); each 8 bytes of this rank's input go to every peer's slot
//! (parity, rank) as a line `{data0, seq, data1, seq}` of atomic words, the
//! flags stored with release after the data; the peers' lines are then
//! placed into the output once both flags of a line read `seq` (acquire).
//! Before its lines a rank stores `{seq, tag}` into each receiver's tag
//! word for it, and a receiver uses a peer's lines only once that word
//! holds this call's number and tag (another tag: `Mismatch`, the peer is
//! making a different call). No barrier: a rank can be at most one call
//! ahead of a peer (each call waits for data every peer sends in it), so
//! the two parities are never overwritten while read.

use crate::array::Array;
use crate::backend::{AllGatherCall, AllReduceLayout, CallTag, ReduceScatterCall};
use crate::error::{err, Result};
use crate::health::Health;
use crate::sync::{spin_until, Ended};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The `u32` at `addr` of a mapped all-reduce buffer.
fn word(addr: u64) -> &'static AtomicU32 {
    // SAFETY: the caller's addresses lie in the group's all-reduce buffers
    // (checked against the layout), 4-byte aligned, mapped while the call
    // runs; every access to them, ours and peers', is atomic.
    unsafe { &*(addr as *const AtomicU32) }
}

/// The `u64` at `addr` of a mapped all-reduce buffer.
fn word64(addr: u64) -> &'static AtomicU64 {
    // SAFETY: as `word`, 8-byte aligned (`AllReduceLayout::tag_at`).
    unsafe { &*(addr as *const AtomicU64) }
}

/// Line `i` (8 bytes, zero past the end) of `bytes` bytes at `base`.
fn load_line(base: u64, i: usize, bytes: usize) -> [u8; 8] {
    let mut line = [0u8; 8];
    let n = (bytes - 8 * i).min(8);
    // SAFETY: the caller's input holds `bytes` bytes.
    unsafe { std::ptr::copy_nonoverlapping((base as *const u8).add(8 * i), line.as_mut_ptr(), n) };
    line
}

fn store_line(base: u64, i: usize, bytes: usize, line: [u8; 8]) {
    let n = (bytes - 8 * i).min(8);
    // SAFETY: the caller's output holds `bytes` bytes at `base`.
    unsafe { std::ptr::copy_nonoverlapping(line.as_ptr(), (base as *mut u8).add(8 * i), n) };
}

/// One call on the buffers: its number and parity, and the line slots.
struct Lines<'a> {
    scratch: &'a [u64],
    layout: AllReduceLayout,
    rank: usize,
    seq: u32,
    tag: CallTag,
    what: &'static str,
}

impl<'a> Lines<'a> {
    /// The call after the last one this rank made on the buffers, or an
    /// error where they cannot carry `bytes` per slot.
    fn begin(
        what: &'static str,
        rank: usize,
        world: usize,
        scratch: &'a [u64],
        scratch_bytes: usize,
        bytes: usize,
        tag: CallTag,
    ) -> Result<Self> {
        if world == 0 || rank >= world || scratch.len() != world {
            return Err(err!(Internal, "{what} for rank {rank} of {world} with {} buffers", scratch.len()));
        }
        let layout = AllReduceLayout::of(scratch_bytes, world);
        if !layout.holds(bytes) {
            return Err(err!(Internal, "an all-reduce buffer of {scratch_bytes} bytes cannot hold {bytes} bytes"));
        }
        let seq = word(scratch[rank]).load(Ordering::Acquire).wrapping_add(1);
        Ok(Lines { scratch, layout, rank, seq, tag, what })
    }

    /// This call's `{seq, tag}` word.
    fn tag_word(&self) -> u64 {
        self.seq as u64 | (self.tag.get() as u64) << 32
    }

    /// Tells `owner` which call this rank's lines to it belong to (before
    /// any of them).
    fn announce(&self, owner: usize) {
        let at = self.scratch[owner] + AllReduceLayout::tag_at((self.seq & 1) as usize, self.rank) as u64;
        word64(at).store(self.tag_word(), Ordering::Release);
    }

    /// Waits for `src`'s word of this call, then `Mismatch` unless it
    /// carries this call's tag.
    fn check(&self, src: usize, health: &Health, deadline: Instant, timeout: Duration) -> Result<()> {
        let at = self.scratch[self.rank] + AllReduceLayout::tag_at((self.seq & 1) as usize, src) as u64;
        let word = word64(at);
        let seq = self.seq;
        let arrived = || word.load(Ordering::Acquire) as u32 == seq;
        spin_until(arrived, || health.interrupted(), deadline).map_err(|why| match why {
            Ended::Failed(e) => e,
            Ended::TimedOut => {
                err!(Timeout, "{}: rank {src} did not start call {seq} within {} ms", self.what, timeout.as_millis())
            }
        })?;
        let found = word.load(Ordering::Acquire);
        if found == self.tag_word() {
            return Ok(());
        }
        Err(CallTag::mismatch(&format!("{}: ", self.what), src, Some((CallTag((found >> 32) as u32), self.tag))))
    }

    /// Line `i` of slot `src` in rank `owner`'s buffer.
    fn at(&self, owner: usize, src: usize, i: usize) -> u64 {
        self.scratch[owner] + (self.layout.one_shot_at((self.seq & 1) as usize, src) + 16 * i) as u64
    }

    /// `line` as line `i` of this rank's slot in `owner`'s buffer, flags
    /// stored with release after the data.
    fn push(&self, owner: usize, i: usize, line: [u8; 8]) {
        let at = self.at(owner, self.rank, i);
        word(at).store(u32::from_le_bytes(line[..4].try_into().unwrap()), Ordering::Relaxed);
        word(at + 8).store(u32::from_le_bytes(line[4..].try_into().unwrap()), Ordering::Relaxed);
        word(at + 4).store(self.seq, Ordering::Release);
        word(at + 12).store(self.seq, Ordering::Release);
    }

    /// Line `i` of slot `src` in this rank's buffer once both its flags
    /// read this call's number.
    fn wait(&self, src: usize, i: usize, health: &Health, deadline: Instant, timeout: Duration) -> Result<[u8; 8]> {
        let at = self.at(self.rank, src, i);
        let seq = self.seq;
        let arrived = || word(at + 4).load(Ordering::Acquire) == seq && word(at + 12).load(Ordering::Acquire) == seq;
        spin_until(arrived, || health.interrupted(), deadline).map_err(|why| match why {
            Ended::Failed(e) => e,
            Ended::TimedOut => err!(
                Timeout,
                "{}: rank {src}'s data did not arrive within {} ms (call {seq})",
                self.what,
                timeout.as_millis()
            ),
        })?;
        let mut line = [0u8; 8];
        line[..4].copy_from_slice(&word(at).load(Ordering::Relaxed).to_le_bytes());
        line[4..].copy_from_slice(&word(at + 8).load(Ordering::Relaxed).to_le_bytes());
        Ok(line)
    }

    /// The call is done here: the next one on the buffers takes the next number.
    fn end(self) {
        word(self.scratch[self.rank]).store(self.seq, Ordering::Release);
    }
}

pub fn all_gather(call: &AllGatherCall, health: &Health) -> Result<()> {
    let &AllGatherCall { rank, world, bytes, input, output, ref scratch, scratch_bytes, timeout, tag, .. } = call;
    let ll = Lines::begin("all_gather", rank, world, scratch, scratch_bytes, bytes, tag)?;
    if bytes == 0 {
        return Ok(());
    }
    let lines = bytes.div_ceil(8);
    let peers = || (1..world).map(|k| (rank + k) % world);
    peers().for_each(|q| ll.announce(q));
    for i in 0..lines {
        let line = load_line(input, i, bytes);
        peers().for_each(|q| ll.push(q, i, line));
        store_line(output + (rank * bytes) as u64, i, bytes, line);
    }
    let deadline = Instant::now() + timeout;
    for src in peers() {
        ll.check(src, health, deadline, timeout)?;
        for i in 0..lines {
            store_line(output + (src * bytes) as u64, i, bytes, ll.wait(src, i, health, deadline, timeout)?);
        }
    }
    ll.end();
    Ok(())
}

/// As the kernel: chunk q of this rank's input to rank q's slot (parity,
/// rank) as lines; then this rank's chunk and its peers' lines summed in
/// f32 in rank order, scaled, into the output (`elementwise::reduce`'s
/// arithmetic: the same bits as either kernel's, so the pieces' algorithm
/// moves its data as lines here too).
pub fn reduce_scatter(call: &ReduceScatterCall, health: &Health) -> Result<()> {
    call.check()?;
    let &ReduceScatterCall {
        algorithm: _,
        rank,
        world,
        dtype,
        n,
        input,
        chunk_stride,
        output,
        scale,
        ref scratch,
        scratch_bytes,
        timeout,
        tag,
    } = call;
    let bytes = n * dtype.size();
    let ll = Lines::begin("reduce_scatter", rank, world, scratch, scratch_bytes, bytes, tag)?;
    if bytes == 0 {
        return Ok(());
    }
    let lines = bytes / 8;
    let chunk = |q: usize| input + (q * chunk_stride) as u64;
    for q in (1..world).map(|k| (rank + k) % world) {
        ll.announce(q);
        (0..lines).for_each(|i| ll.push(q, i, load_line(chunk(q), i, bytes)));
    }
    // Every rank's part of this chunk, in rank order, as contiguous arrays.
    let deadline = Instant::now() + timeout;
    let mut received: Vec<Vec<u64>> = Vec::with_capacity(world);
    for src in 0..world {
        let words = (0..lines)
            .map(|i| match src == rank {
                true => Ok(load_line(chunk(rank), i, bytes)),
                false if i == 0 => {
                    ll.check(src, health, deadline, timeout).and_then(|()| ll.wait(src, i, health, deadline, timeout))
                }
                false => ll.wait(src, i, health, deadline, timeout),
            })
            .map(|line| line.map(u64::from_le_bytes))
            .collect::<Result<Vec<u64>>>()?;
        received.push(words);
    }
    let srcs: Vec<Array> = received.iter().map(|w| Array::contiguous(w.as_ptr() as u64, dtype, &[n])).collect();
    super::elementwise::reduce(&Array::contiguous(output, dtype, &[n]), &srcs, scale)?;
    ll.end();
    Ok(())
}
