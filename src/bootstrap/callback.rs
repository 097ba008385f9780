//! Bootstrap through the caller's own collectives (MPI, a framework's
//! process group...), given as closures. The C adapter that turns
//! `symm_bootstrap_t` function pointers into these closures lives in `ffi`.
//!
//! Timeouts are the callbacks' responsibility: symm cannot interrupt a
//! foreign collective, so the `timeout` passed to [`Bootstrap`] methods is
//! not enforced here, and a callback that never returns hangs its caller.

use super::Bootstrap;
use crate::error::{ensure, err, Error, Result};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use std::time::Duration;

/// `allgather(send, recv)`: gathers `send` from every rank into `recv`
/// (`world * send.len()` bytes) in rank order.
pub type AllgatherFn = Box<dyn Fn(&[u8], &mut [u8]) -> Result<()> + Send + Sync>;
/// `barrier()`: returns once every rank has called it. Optional, and
/// called only through [`Bootstrap::barrier`]: every collective symm runs
/// carries data (at least each rank's success or failure), so its own
/// operations gather through `allgather` and take no bare barrier.
pub type BarrierFn = Box<dyn Fn() -> Result<()> + Send + Sync>;

pub struct CallbackBootstrap {
    rank: usize,
    world: usize,
    allgather: AllgatherFn,
    barrier: Option<BarrierFn>,
    /// Foreign collectives are rarely safe to enter concurrently; this keeps
    /// the callbacks from ever running on two threads at once.
    serial: Mutex<()>,
}

impl CallbackBootstrap {
    /// Wraps the caller's collectives for rank `rank` of `world`. Without a
    /// barrier, barriers are 1-byte all-gathers. The caller vouches for
    /// `rank < world` (group init checks it); [`CallbackBootstrap::try_new`]
    /// checks it here.
    pub fn new(rank: usize, world: usize, allgather: AllgatherFn, barrier: Option<BarrierFn>) -> Self {
        CallbackBootstrap { rank, world, allgather, barrier, serial: Mutex::new(()) }
    }

    /// [`CallbackBootstrap::new`], rejecting `world == 0` and `rank >= world`.
    pub fn try_new(rank: usize, world: usize, allgather: AllgatherFn, barrier: Option<BarrierFn>) -> Result<Self> {
        ensure!(world >= 1, InvalidArgument, "bootstrap: world size must be at least 1");
        ensure!(rank < world, InvalidArgument, "bootstrap: rank {rank} is out of range for world size {world}");
        Ok(Self::new(rank, world, allgather, barrier))
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
        let mut recv = vec![0u8; total];
        self.call("allgather", || (self.allgather)(data, &mut recv))?;
        Ok(recv)
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        match &self.barrier {
            Some(b) => self.call("barrier", b),
            None => self.allgather(&[0u8], timeout).map(|_| ()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::local::local_bootstraps;
    use crate::error::ErrorKind;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::thread;

    const T: Duration = Duration::from_secs(10);

    /// Callback bootstraps whose allgather runs over an in-process group,
    /// standing in for MPI.
    fn over_local(n: usize, with_barrier: bool, barriers: Arc<AtomicUsize>) -> Vec<CallbackBootstrap> {
        local_bootstraps(n)
            .into_iter()
            .enumerate()
            .map(|(r, lb)| {
                let lb = Arc::new(lb);
                let lb2 = lb.clone();
                let ag: AllgatherFn = Box::new(move |s, d| {
                    d.copy_from_slice(&lb.allgather(s, T)?);
                    Ok(())
                });
                let counter = barriers.clone();
                let bar: Option<BarrierFn> = with_barrier.then(|| {
                    Box::new(move || {
                        counter.fetch_add(1, Ordering::SeqCst);
                        lb2.barrier(T)
                    }) as BarrierFn
                });
                CallbackBootstrap::try_new(r, n, ag, bar).unwrap()
            })
            .collect()
    }

    fn run_all(bs: Vec<CallbackBootstrap>) -> Vec<Vec<u8>> {
        let hs: Vec<_> = bs
            .into_iter()
            .map(|b| {
                thread::spawn(move || {
                    let all = b.allgather(&[b.rank() as u8; 3], T).unwrap();
                    b.barrier(T).unwrap();
                    all
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn allgather_and_given_barrier() {
        let count = Arc::new(AtomicUsize::new(0));
        let out = run_all(over_local(3, true, count.clone()));
        assert!(out.iter().all(|o| o == &[0, 0, 0, 1, 1, 1, 2, 2, 2]));
        assert_eq!(count.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn barrier_falls_back_to_allgather() {
        let count = Arc::new(AtomicUsize::new(0));
        let out = run_all(over_local(2, false, count.clone()));
        assert!(out.iter().all(|o| o == &[0, 0, 0, 1, 1, 1]));
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn failures_become_bootstrap_errors() {
        let ag: AllgatherFn = Box::new(|_, _| Err(err!(Timeout, "peer gone")));
        let bar: BarrierFn = Box::new(|| panic!("boom"));
        let b = CallbackBootstrap::new(0, 2, ag, Some(bar));
        let e = b.allgather(&[1], T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert_eq!(e.msg, "bootstrap: the allgather callback failed: peer gone");
        let e = b.barrier(T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains("panicked"), "{e}");
    }

    #[test]
    fn validates_rank_and_world() {
        let mk = || -> AllgatherFn { Box::new(|_, _| Ok(())) };
        assert_eq!(CallbackBootstrap::try_new(2, 2, mk(), None).unwrap_err().kind, ErrorKind::InvalidArgument);
        assert!(CallbackBootstrap::try_new(0, 0, mk(), None).is_err());
    }
}
