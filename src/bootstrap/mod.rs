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

/// All-gather of byte strings whose length may differ per rank. Each rank
/// sends its length and first [`INLINE`] bytes in one fixed-size exchange;
/// only where some rank has more does a second exchange carry the rest,
/// padded to the longest (every rank sees every length, so all of them
/// take it or none does).
pub fn allgather_var(bs: &dyn Bootstrap, data: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
    const SLOT: usize = 8 + INLINE;
    let head = data.len().min(INLINE);
    let mut first = Writer::new().u64(data.len() as u64).finish();
    first.extend_from_slice(&data[..head]);
    first.resize(SLOT, 0);
    let all = bs.allgather(&first, timeout)?;
    if all.len() != bs.world() * SLOT {
        return Err(err!(Internal, "the bootstrap returned {} bytes for {} ranks of {SLOT}", all.len(), bs.world()));
    }
    let slots: Vec<&[u8]> = all.chunks(SLOT).collect();
    let lens: Vec<usize> = slots
        .iter()
        .map(|s| Reader::new(&s[..8], "payload length").u64().map(|n| n as usize))
        .collect::<Result<_>>()?;
    let longest = lens.iter().map(|n| n.saturating_sub(INLINE)).max().unwrap_or(0);
    let rest = match longest {
        0 => Vec::new(),
        _ => {
            let mut tail = data[head..].to_vec();
            tail.resize(longest, 0);
            bs.allgather(&tail, timeout)?
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
