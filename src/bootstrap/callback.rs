//! Bootstrap through the caller's own collectives (MPI, a framework's
//! process group...), given as closures. The C adapter that turns
//! `symm_bootstrap_t` function pointers into these closures lives in `ffi`.
//!
//! Timeouts are the callbacks' responsibility: symm cannot interrupt a
//! foreign collective, so the `timeout` passed to [`Bootstrap`] methods is
//! not enforced here, and a callback that never returns hangs its caller.

use super::Bootstrap;
use crate::error::{err, Error, Result};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use std::time::Duration;

/// `allgather(send, recv)`: gathers `send` from every rank into `recv`
/// (`world * send.len()` bytes) in rank order.
pub type AllgatherFn = Box<dyn Fn(&[u8], &mut [u8]) -> Result<()> + Send + Sync>;

/// A caller's allgather. A barrier callback, where the caller gave one (the
/// C struct has room for it), is not kept: [`Bootstrap`] has no barrier.
pub struct CallbackBootstrap {
    rank: usize,
    world: usize,
    allgather: AllgatherFn,
    /// Foreign collectives are rarely safe to enter concurrently; this keeps
    /// the callbacks from ever running on two threads at once.
    serial: Mutex<()>,
}

impl CallbackBootstrap {
    /// Wraps the caller's allgather for rank `rank` of `world`. The caller
    /// vouches for `rank < world` (group init checks it).
    pub fn new(rank: usize, world: usize, allgather: AllgatherFn) -> Self {
        CallbackBootstrap { rank, world, allgather, serial: Mutex::new(()) }
    }

    /// Runs a callback under the serial lock, turning its failure or panic
    /// into a bootstrap error that says which callback failed.
    fn call<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _serial = crate::sync::lock(&self.serial);
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(wrap(what, e)),
            Err(_) => Err(err!(Bootstrap, "bootstrap: the {what} callback panicked")),
        }
    }
}

fn wrap(what: &str, e: Error) -> Error {
    err!(Bootstrap, "bootstrap: the {what} callback failed: {}", e.msg)
}

impl fmt::Debug for CallbackBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CallbackBootstrap(rank {} of {})", self.rank, self.world)
    }
}

impl Bootstrap for CallbackBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    /// `timeout` is not enforced: see the module documentation.
    fn allgather(&self, data: &[u8], _timeout: Duration) -> Result<Vec<u8>> {
        let total = data
            .len()
            .checked_mul(self.world)
            .ok_or_else(|| err!(InvalidArgument, "bootstrap: {} x {} bytes overflows", self.world, data.len()))?;
        let mut recv = super::zeroed(total, &format_args!("{} ranks' {} bytes", self.world, data.len()))?;
        self.call("allgather", || (self.allgather)(data, &mut recv))?;
        Ok(recv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::local::local_bootstraps;
    use crate::error::ErrorKind;
    use std::sync::Arc;
    use std::thread;

    const T: Duration = Duration::from_secs(10);

    /// Callback bootstraps whose allgather runs over an in-process group,
    /// standing in for MPI.
    fn over_local(n: usize) -> Vec<CallbackBootstrap> {
        local_bootstraps(n)
            .into_iter()
            .enumerate()
            .map(|(r, lb)| {
                let lb = Arc::new(lb);
                let ag: AllgatherFn = Box::new(move |s, d| {
                    d.copy_from_slice(&lb.allgather(s, T)?);
                    Ok(())
                });
                CallbackBootstrap::new(r, n, ag)
            })
            .collect()
    }

    #[test]
    fn allgather_in_rank_order() {
        let hs: Vec<_> = over_local(3)
            .into_iter()
            .map(|b| thread::spawn(move || b.allgather(&[b.rank() as u8; 3], T).unwrap()))
            .collect();
        let out: Vec<Vec<u8>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(out.iter().all(|o| o == &[0, 0, 0, 1, 1, 1, 2, 2, 2]));
    }

    #[test]
    fn failures_become_bootstrap_errors() {
        let ag: AllgatherFn = Box::new(|_, _| Err(err!(Timeout, "peer gone")));
        let e = CallbackBootstrap::new(0, 2, ag).allgather(&[1], T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert_eq!(e.msg, "bootstrap: the allgather callback failed: peer gone");
        let ag: AllgatherFn = Box::new(|_, _| panic!("boom"));
        let e = CallbackBootstrap::new(0, 2, ag).allgather(&[1], T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains("panicked"), "{e}");
    }
}
