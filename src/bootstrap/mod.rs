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
//! - [`env`]: torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`,
//!   rank 0 hosting the store (a uid-checked Unix socket when every rank is
//!   on one host; TCP with `SYMM_BOOTSTRAP_SECRET` across hosts);
//! - [`local`]: several ranks in one process, exchanging through memory.

pub mod callback;
pub mod env;
pub mod local;
pub mod tcp;
pub mod unique_id;

use crate::error::Result;
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

/// All-gather of byte strings whose length may differ per rank: lengths go
/// first, then payloads padded to the longest.
pub fn allgather_var(bs: &dyn Bootstrap, data: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
    let lens = bs.allgather(&Writer::new().u64(data.len() as u64).finish(), timeout)?;
    let mut r = Reader::new(&lens, "payload lengths");
    let lens: Vec<usize> = (0..bs.world()).map(|_| r.u64().map(|n| n as usize)).collect::<Result<_>>()?;
    let max = lens.iter().copied().max().unwrap_or(0);
    let mut padded = data.to_vec();
    padded.resize(max, 0);
    let all = bs.allgather(&padded, timeout)?;
    Ok(lens.iter().enumerate().map(|(r, &n)| all[r * max..r * max + n].to_vec()).collect())
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
