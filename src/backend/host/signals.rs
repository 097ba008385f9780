//! Signals on the host: `u32` slots in the shared pads, driven by atomics.
//! Put = CAS 0 -> tag (release) on the peer's slot for us; wait = CAS
//! tag -> 0 (acquire) on our slot for the peer, failing with `Mismatch`
//! where the slot holds another call's tag. Waiting spins briefly, then yields,
//! then sleeps, so many ranks on few cores still make progress. A wait
//! also ends as soon as the group fails (an abort, a peer's failure on the
//! group's board), with that failure.

use crate::backend::{slot_offset, CallTag, PadSet, Signals, Stream};
use crate::error::{err, Result};
use crate::health::Health;
use crate::sync::{spin_until, Ended};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct HostSignals {
    pads: PadSet,
    health: Arc<Health>,
}

impl HostSignals {
    pub fn new(pads: PadSet, health: Arc<Health>) -> Self {
        HostSignals { pads, health }
    }

    /// Polls `done` until it returns true, the deadline passes or the group fails.
    fn spin(&self, done: impl FnMut() -> bool, deadline: Instant) -> std::result::Result<(), Ended> {
        spin_until(done, || self.health.interrupted(), deadline)
    }

    /// The slot `pad[channel][src]` in `owner`'s pad.
    fn slot(&self, owner: usize, channel: usize, src: usize) -> &AtomicU32 {
        let addr = self.pads.pads[owner] + slot_offset(self.pads.world, channel, src) as u64;
        // SAFETY: pads are mapped for the lifetime of the handle that owns
        // these signals, slots are 4-byte aligned, and every access to them
        // (ours and peers') is atomic.
        unsafe { &*(addr as *const AtomicU32) }
    }

    fn check(&self, peer: usize, channel: usize) -> Result<()> {
        let PadSet { rank, world, .. } = self.pads;
        if peer >= world || peer == rank {
            return Err(err!(
                InvalidArgument,
                "peer {peer} is not another rank of this group of {world} (this is rank {rank})"
            ));
        }
        if !self.pads.reaches(peer) {
            return Err(err!(Unsupported, "rank {peer} is on another host: its signal pad is not mapped here"));
        }
        check_channel(channel)
    }

    fn put_unchecked(
        &self,
        peer: usize,
        channel: usize,
        tag: CallTag,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<()> {
        let slot = self.slot(peer, channel, self.pads.rank);
        let done = || slot.compare_exchange(0, tag.get(), Ordering::Release, Ordering::Relaxed).is_ok();
        self.spin(done, deadline).map_err(|why| match why {
            Ended::Failed(e) => e,
            Ended::TimedOut => err!(
                Timeout,
                "put_signal: rank {peer} did not consume the previous signal on channel {channel} within {} ms",
                timeout.as_millis()
            ),
        })
    }

    fn wait_unchecked(
        &self,
        peer: usize,
        channel: usize,
        tag: CallTag,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<()> {
        let slot = self.slot(self.pads.rank, channel, peer);
        let mut other = 0;
        let done = || match slot.compare_exchange(tag.get(), 0, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => true,
            Err(0) => false,
            Err(found) => {
                other = found;
                true
            }
        };
        self.spin(done, deadline).map_err(|why| match why {
            Ended::Failed(e) => e,
            Ended::TimedOut => err!(
                Timeout,
                "wait_signal: rank {peer} did not signal channel {channel} within {} ms",
                timeout.as_millis()
            ),
        })?;
        match other {
            0 => Ok(()),
            found => Err(CallTag::mismatch(
                &format!("wait_signal on channel {channel}: "),
                peer,
                Some((CallTag(found), tag)),
            )),
        }
    }
}

impl Signals for HostSignals {
    fn write_value(&self, addr: u64, value: u32, _stream: Stream) -> Result<()> {
        flag(addr).store(value, Ordering::Release);
        Ok(())
    }

    fn wait_value(&self, addr: u64, value: u32, owner: usize, _stream: Stream, timeout: Duration) -> Result<()> {
        let f = flag(addr);
        self.spin(|| f.load(Ordering::Acquire) >= value, Instant::now() + timeout)
            .map_err(|why| match why {
                Ended::Failed(e) => e,
                Ended::TimedOut => err!(
                    Timeout,
                    "wait_value: the flag in rank {owner}'s buffer did not reach {value} within {} ms (it is {})",
                    timeout.as_millis(),
                    f.load(Ordering::Relaxed)
                ),
            })
            .inspect_err(|e| log::warn!("{}", e.msg))
    }

    fn put(&self, peer: usize, channel: usize, tag: CallTag, _stream: Stream, timeout: Duration) -> Result<()> {
        self.check(peer, channel)?;
        self.put_unchecked(peer, channel, tag, Instant::now() + timeout, timeout)
            .inspect_err(|e| log::warn!("{}", e.msg))
    }

    fn wait(&self, peer: usize, channel: usize, tag: CallTag, _stream: Stream, timeout: Duration) -> Result<()> {
        self.check(peer, channel)?;
        self.wait_unchecked(peer, channel, tag, Instant::now() + timeout, timeout)
            .inspect_err(|e| log::warn!("{}", e.msg))
    }

    fn barrier(&self, channel: usize, tag: CallTag, _stream: Stream, timeout: Duration) -> Result<()> {
        check_channel(channel)?;
        let PadSet { rank, world, .. } = self.pads;
        let deadline = Instant::now() + timeout;
        let peers = || (1..world).map(move |i| (rank + i) % world).filter(|&p| self.pads.reaches(p));
        for p in peers() {
            self.put_unchecked(p, channel, tag, deadline, timeout).inspect_err(|e| log::warn!("barrier: {}", e.msg))?;
        }
        // Wait for everyone before failing, so the error names every late
        // rank; a failed group ends the wait at once.
        let mut late = Vec::new();
        for p in peers() {
            match self.wait_unchecked(p, channel, tag, deadline, timeout) {
                Ok(()) => {}
                Err(e) if e.kind == crate::error::ErrorKind::Timeout => late.push(p),
                Err(e) => return Err(e),
            }
        }
        if late.is_empty() {
            Ok(())
        } else {
            let e = err!(
                Timeout,
                "barrier on channel {channel}: {} did not arrive within {} ms",
                crate::bootstrap::name_ranks(&late),
                timeout.as_millis()
            );
            log::warn!("{}", e.msg);
            Err(e)
        }
    }
}

/// The `u32` at `addr`, shared with other processes.
fn flag(addr: u64) -> &'static AtomicU32 {
    // SAFETY: callers pass a 4-byte aligned address inside a live mapping
    // of a handle (checked by the buffer layer); all accesses are atomic.
    unsafe { &*(addr as *const AtomicU32) }
}

fn check_channel(channel: usize) -> Result<()> {
    if channel >= crate::backend::SIGNAL_CHANNELS {
        return Err(err!(
            InvalidArgument,
            "channel {channel} is out of range (0..{})",
            crate::backend::SIGNAL_CHANNELS
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::pad_bytes;

    fn pads(world: usize) -> (Vec<Vec<u32>>, Vec<HostSignals>) {
        let mut mem: Vec<Vec<u32>> = (0..world).map(|_| vec![0u32; pad_bytes(world) / 4]).collect();
        let addrs: Vec<u64> = mem.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
        let sigs = (0..world)
            .map(|rank| HostSignals::new(PadSet { rank, world, pads: addrs.clone() }, Arc::new(Health::new(rank))))
            .collect();
        (mem, sigs)
    }

    #[test]
    fn put_then_wait_resets_slot() {
        let (mem, s) = pads(2);
        let t = Duration::from_millis(200);
        s[0].put(1, 3, CallTag::USER, Stream(0), t).unwrap();
        assert_eq!(mem[1][slot_offset(2, 3, 0) / 4], CallTag::USER.get());
        s[1].wait(0, 3, CallTag::USER, Stream(0), t).unwrap();
        assert_eq!(mem[1][slot_offset(2, 3, 0) / 4], 0);
    }

    #[test]
    fn wait_times_out_naming_peer() {
        let (_mem, s) = pads(3);
        let e = s[0].wait(2, 0, CallTag::USER, Stream(0), Duration::from_millis(30)).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Timeout);
        assert!(e.msg.contains("rank 2"), "{}", e.msg);
    }

    #[test]
    fn barrier_across_threads_and_missing_rank() {
        let (_mem, s) = pads(3);
        let t = Duration::from_secs(5);
        std::thread::scope(|sc| {
            for sig in &s {
                sc.spawn(move || sig.barrier(1, CallTag::USER, Stream(0), t).unwrap());
            }
        });
        // Rank 2 never arrives: ranks 0 and 1 name it.
        let short = Duration::from_millis(50);
        std::thread::scope(|sc| {
            for sig in &s[..2] {
                sc.spawn(move || {
                    let e = sig.barrier(2, CallTag::USER, Stream(0), short).unwrap_err();
                    assert!(e.msg.contains("rank 2 did not arrive"), "{}", e.msg);
                });
            }
        });
    }

    /// A wait that finds another call's tag fails with `Mismatch` at once
    /// and leaves the signal; the matching wait consumes it.
    #[test]
    fn a_signal_of_another_call_is_a_mismatch() {
        let (mem, s) = pads(2);
        let (t, ours, theirs) = (Duration::from_secs(30), CallTag::of(b"ours"), CallTag::of(b"theirs"));
        assert_ne!(ours, theirs);
        s[0].put(1, 2, theirs, Stream(0), t).unwrap();
        let start = Instant::now();
        let e = s[1].wait(0, 2, ours, Stream(0), t).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "{}", e.msg);
        assert!(e.msg.contains("rank 0 is making a different call"), "{}", e.msg);
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(mem[1][slot_offset(2, 2, 0) / 4], theirs.get());
        s[1].wait(0, 2, theirs, Stream(0), t).unwrap();
        assert_eq!(mem[1][slot_offset(2, 2, 0) / 4], 0);
        // A barrier of two calls: each rank finds the other's tag.
        std::thread::scope(|sc| {
            for (sig, tag) in s.iter().zip([ours, theirs]) {
                sc.spawn(move || {
                    let e = sig.barrier(3, tag, Stream(0), t).unwrap_err();
                    assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "{}", e.msg);
                });
            }
        });
    }

    #[test]
    fn call_tags_are_never_free_slots_or_user_signals() {
        for bytes in [&b""[..], b"a", b"operation=ag_mm", &[0u8; 64]] {
            assert!(CallTag::of(bytes).get() >= 2, "{bytes:?}");
        }
        assert_eq!(CallTag::of(b"x"), CallTag::of(b"x"));
        assert_ne!(CallTag::of(b"x"), CallTag::of(b"y"));
    }

    #[test]
    fn bad_peer_and_channel() {
        let (_mem, s) = pads(2);
        let t = Duration::from_millis(10);
        assert_eq!(
            s[0].put(0, 0, CallTag::USER, Stream(0), t).unwrap_err().kind,
            crate::error::ErrorKind::InvalidArgument
        );
        assert_eq!(
            s[0].put(5, 0, CallTag::USER, Stream(0), t).unwrap_err().kind,
            crate::error::ErrorKind::InvalidArgument
        );
        assert_eq!(
            s[0].wait(1, 99, CallTag::USER, Stream(0), t).unwrap_err().kind,
            crate::error::ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn a_failed_group_ends_waits_at_once() {
        let (_mem, s) = pads(2);
        let t = Duration::from_secs(30);
        std::thread::scope(|sc| {
            let waiting = sc.spawn(|| {
                let start = Instant::now();
                (s[0].wait(1, 0, CallTag::USER, Stream(0), t).unwrap_err(), start.elapsed())
            });
            std::thread::sleep(Duration::from_millis(50));
            s[0].health.abort();
            let (e, waited) = waiting.join().unwrap();
            assert_eq!(e.kind, crate::error::ErrorKind::Aborted);
            assert!(waited < Duration::from_secs(5), "{waited:?}");
        });
        let e = s[0].barrier(0, CallTag::USER, Stream(0), t).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Aborted);
    }
}
