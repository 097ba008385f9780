//! Locking that survives a panicking holder, and polling for what peers
//! write into shared memory.
//!
//! Every mutex in symm guards state that stays consistent between
//! statements (maps, counters, caches), so a panic in one holder is no
//! reason to fail every later caller: these helpers take the guard out of
//! a poisoned lock instead of unwrapping.

use crate::error::Error;
use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Locks `m`, ignoring poisoning.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Read-locks `l`, ignoring poisoning.
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

/// Write-locks `l`, ignoring poisoning.
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// `m`'s value through exclusive access (no locking), ignoring poisoning.
pub(crate) fn get_mut<T>(m: &mut Mutex<T>) -> &mut T {
    m.get_mut().unwrap_or_else(|p| p.into_inner())
}

/// Waits on `cv` for at most `timeout`, ignoring poisoning.
pub(crate) fn wait_timeout<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, timeout).unwrap_or_else(|p| p.into_inner()).0
}

/// Waits on `cv` until notified, ignoring poisoning.
pub(crate) fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|p| p.into_inner())
}

/// Why a wait ended without its condition.
pub(crate) enum Ended {
    TimedOut,
    Failed(Error),
}

/// Polls `done` until it returns true, `deadline` passes, or `failed`
/// (looked at between sleeps) returns the group's failure. It spins
/// briefly, then yields, then sleeps, so that many ranks on few cores
/// still make progress.
pub(crate) fn spin_until(
    mut done: impl FnMut() -> bool,
    failed: impl Fn() -> Option<Error>,
    deadline: Instant,
) -> std::result::Result<(), Ended> {
    let mut tries = 0u32;
    loop {
        if done() {
            return Ok(());
        }
        tries = tries.saturating_add(1);
        if tries < 256 {
            std::hint::spin_loop();
        } else if tries < 1024 {
            std::thread::yield_now();
        } else {
            if let Some(e) = failed() {
                return Err(Ended::Failed(e));
            }
            if Instant::now() >= deadline {
                // One last look: the peer may have arrived while we slept.
                return if done() { Ok(()) } else { Err(Ended::TimedOut) };
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_still_opens() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
