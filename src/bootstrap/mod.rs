//! How ranks find each other and exchange small metadata.
//!
//! Every way of bootstrapping implements [`Bootstrap`]: an all-gather of
//! equal-length byte strings, in rank order. Everything collective in symm
//! (group formation, rendezvous, argument agreement) is built on it.
//!
//! Four ways exist:
//! - [`tcp`]: an embedded TCP store started by `symm_get_unique_id`, found
//!   through a 128-byte [`unique_id::UniqueId`] that carries its address and
//!   a secret;
//! - [`callback`]: the caller's own allgather function;
//! - [`env`](mod@env): torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`,
//!   rank 0 hosting the store (a uid-checked Unix socket when every rank is
//!   on one host; TCP with `SYMM_BOOTSTRAP_SECRET` across hosts);
//! - [`local`]: several ranks in one process, exchanging through memory.

pub mod callback;
pub mod env;
pub mod local;
pub mod tcp;
pub mod unique_id;

use crate::error::{err, Result};
use crate::wire::{Reader, Writer};
use std::time::Duration;

/// Collective exchange among the ranks of one group.
///
/// Calls are collective: every rank calls the same sequence of methods.
/// Implementations are internally synchronized, but callers must not issue
/// two collectives of one group concurrently from different threads.
pub trait Bootstrap: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Gathers `data` (the same length on every rank) from all ranks and
    /// returns the concatenation in rank order (`world * data.len()` bytes).
    ///
    /// Fails with `ErrorKind::Timeout` when some rank has not contributed
    /// within `timeout`; the message names those ranks ("ranks [2, 3] did not
    /// arrive within 5000 ms"). A length that differs between ranks is
    /// `ErrorKind::Mismatch` where it can be detected.
    ///
    /// The only collective: symm's exchanges all carry data (at least each
    /// rank's success or failure), so none of them is a bare barrier.
    fn allgather(&self, data: &[u8], timeout: Duration) -> Result<Vec<u8>>;
}

/// Bytes of a payload that travel in [`allgather_var`]'s first exchange:
/// an operation's arguments and status fit, so agreeing on a call is one
/// round trip.
const INLINE: usize = 504;

/// Bits of [`allgather_var`]'s length word that hold the length; the
/// rest hold [`length_check`] of it.
const LENGTH_BITS: u32 = 48;

/// A check of a payload length, so that corrupt bytes from a bootstrap
/// (a caller's allgather) are reported as such rather than taken for a
/// length to allocate.
fn length_check(n: u64) -> u64 {
    (n ^ (n >> 16) ^ (n >> 32) ^ 0x5359) & 0xffff
}

/// A zeroed buffer of `len` bytes, or an error where the process cannot
/// have one: the lengths come from peers, and a failed allocation would
/// abort the process.
pub(crate) fn zeroed(len: usize, what: &dyn std::fmt::Display) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| err!(OutOfMemory, "bootstrap: cannot allocate {len} bytes for {what}"))?;
    v.resize(len, 0);
    Ok(v)
}

/// All-gather of byte strings whose length may differ per rank. Each rank
/// sends its length and first [`INLINE`] bytes in one fixed-size exchange;
/// only where some rank has more does a second exchange carry the rest,
/// padded to the longest (every rank sees every length, so all of them
/// take it or none does). Data that do not parse (a corrupt length, or
/// fewer bytes than the lengths promise) are `Bootstrap` errors.
pub fn allgather_var(bs: &dyn Bootstrap, data: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
    const SLOT: usize = 8 + INLINE;
    let len = data.len() as u64;
    if len >> LENGTH_BITS != 0 {
        return Err(err!(InvalidArgument, "bootstrap: a payload of {len} bytes is more than an exchange carries"));
    }
    let head = data.len().min(INLINE);
    let mut first = Writer::new().u64(len | (length_check(len) << LENGTH_BITS)).finish();
    first.extend_from_slice(&data[..head]);
    first.resize(SLOT, 0);
    let all = bs.allgather(&first, timeout)?;
    if all.len() != bs.world() * SLOT {
        return Err(err!(Bootstrap, "the bootstrap returned {} bytes for {} ranks of {SLOT}", all.len(), bs.world()));
    }
    let slots: Vec<&[u8]> = all.chunks(SLOT).collect();
    let lens: Vec<usize> = slots
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let word = Reader::new(&s[..8], "payload length").u64()?;
            let n = word & ((1 << LENGTH_BITS) - 1);
            match word >> LENGTH_BITS == length_check(n) {
                true => Ok(n as usize),
                false => Err(err!(
                    Bootstrap,
                    "bootstrap: rank {r}'s data are corrupt (length word {word:#018x}); does its allgather \
                     gather every rank's bytes unchanged, in rank order?"
                )),
            }
        })
        .collect::<Result<_>>()?;
    let longest = lens.iter().map(|n| n.saturating_sub(INLINE)).max().unwrap_or(0);
    let rest = match longest {
        0 => Vec::new(),
        _ => {
            let mut tail = zeroed(longest, &format_args!("the ranks' payloads of up to {longest} bytes"))?;
            tail[..data.len() - head].copy_from_slice(&data[head..]);
            let rest = bs.allgather(&tail, timeout)?;
            if Some(rest.len()) != longest.checked_mul(bs.world()) {
                return Err(err!(
                    Bootstrap,
                    "the bootstrap returned {} bytes for {} ranks of {longest}",
                    rest.len(),
                    bs.world()
                ));
            }
            rest
        }
    };
    Ok(lens
        .iter()
        .zip(&slots)
        .enumerate()
        .map(|(r, (&n, slot))| {
            let mut v = slot[8..8 + n.min(INLINE)].to_vec();
            v.extend_from_slice(&rest[r * longest..r * longest + n.saturating_sub(INLINE)]);
            v
        })
        .collect())
}

/// Test helper: runs `f` on every rank's bootstrap, each on its own thread,
/// and returns the results in rank order.
#[cfg(test)]
pub(crate) fn on_ranks<B: Bootstrap + 'static, R: Send + 'static>(
    bs: Vec<B>,
    f: impl Fn(&B) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = std::sync::Arc::new(f);
    let hs: Vec<_> = bs
        .into_iter()
        .map(|b| {
            let f = f.clone();
            std::thread::spawn(move || f(&b))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Formats a rank list for error messages: "rank 3" or "ranks [1, 3]".
pub fn name_ranks(ranks: &[usize]) -> String {
    match ranks {
        [r] => format!("rank {r}"),
        _ => format!("ranks {ranks:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// Rank 0 of 2, whose all-gather makes rank 1's bytes from this rank's
    /// with `forge` (the exchange's number, the bytes) and returns as many
    /// bytes as that leaves: a caller's bootstrap gone wrong.
    struct Forged(fn(usize, &mut Vec<u8>));

    impl Bootstrap for Forged {
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            2
        }
        fn allgather(&self, data: &[u8], _: Duration) -> Result<Vec<u8>> {
            let mut peer = data.to_vec();
            (self.0)(data.len(), &mut peer);
            Ok([data, &peer].concat())
        }
    }

    /// A first exchange's slot claiming a payload of `n` bytes, its check
    /// intact.
    fn claim(slot: &mut [u8], n: u64) {
        slot[..8].copy_from_slice(&(n | (length_check(n) << LENGTH_BITS)).to_le_bytes());
    }

    /// Corrupt peer data are a `Bootstrap` error, not a panic, an abort on
    /// a huge allocation or a slice past the received bytes.
    #[test]
    fn corrupt_peer_data_are_bootstrap_errors() {
        const FIRST: usize = 8 + INLINE;
        type Forge = fn(usize, &mut Vec<u8>);
        let cases: [(&str, Forge); 5] = [
            ("ones", |_, p| p.fill(0xff)),
            ("zeros", |_, p| p.fill(0)),
            ("a 1 TiB length, unchecked", |_, p| p[..8].copy_from_slice(&(1u64 << 40).to_le_bytes())),
            ("a length with a bit flipped", |_, p| p[2] ^= 4),
            ("a second exchange cut short", |n, p| match n {
                FIRST => claim(p, 600),
                _ => p.truncate(10),
            }),
        ];
        for (what, forge) in cases {
            let e = allgather_var(&Forged(forge), &[1, 2, 3], Duration::ZERO).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Bootstrap, "{what}: {e}");
            assert!(e.msg.contains("rank 1's data are corrupt") || e.msg.contains("the bootstrap returned"), "{e}");
        }
        // A length that checks but that no process can hold (past the
        // address space) fails the allocation as an error.
        let e = allgather_var(&Forged(|_, p| claim(p, (1 << LENGTH_BITS) - 1)), &[1], Duration::ZERO).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory, "{e}");
        // Intact data still pass, in one exchange or two.
        for len in [3, 600] {
            let got = allgather_var(&Forged(|_, _| {}), &vec![5; len], Duration::ZERO).unwrap();
            assert_eq!(got, vec![vec![5; len]; 2]);
        }
    }
}
