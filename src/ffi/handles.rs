//! Opaque handles. A handle's value is a key into a per-type registry, never
//! a pointer we dereference: a destroyed, forged or wrong-type handle is
//! reported as `SYMM_ERROR_INVALID_HANDLE` instead of crashing, and a call
//! racing with destroy keeps its object alive through the `Arc` it got.
//!
//! A process forked from the one that made an object inherits the object's
//! memory but not its place in the group: its sockets and mappings are the
//! parent's, so using it there (or destroying it, which says goodbye to the
//! bootstrap store) would disturb the parent's group. Objects remember the
//! fork count at their making, and a child refuses its parent's.

use crate::error::{err, Result};
use crate::sync::lock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};

/// Forks this process descends through, counted in each child.
static FORKS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn in_forked_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

fn count_forks() -> usize {
    static WATCH: Once = Once::new();
    // SAFETY: registers a handler that only bumps an atomic.
    WATCH.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(in_forked_child));
    });
    FORKS.load(Ordering::Relaxed)
}

pub struct Registry<T> {
    /// Low bits of every key of this registry, so keys of different types
    /// never collide.
    tag: usize,
    what: &'static str,
    next: AtomicUsize,
    /// Each object with the fork count at its making.
    live: Mutex<BTreeMap<usize, (usize, Arc<T>)>>,
}

const TAG_BITS: u32 = 4;

impl<T> Registry<T> {
    pub const fn new(tag: usize, what: &'static str) -> Self {
        Registry { tag, what, next: AtomicUsize::new(1), live: Mutex::new(BTreeMap::new()) }
    }

    pub fn insert(&self, v: Arc<T>) -> usize {
        // Keys are never reused, so a stale handle cannot alias a new object.
        let key = (self.next.fetch_add(1, Ordering::Relaxed) << TAG_BITS) | self.tag;
        lock(&self.live).insert(key, (count_forks(), v));
        key
    }

    pub fn get(&self, key: usize) -> Result<Arc<T>> {
        if key == 0 {
            return Err(err!(InvalidHandle, "{} is NULL", self.what));
        }
        let live = lock(&self.live);
        let (made, v) = live.get(&key).ok_or_else(|| self.unknown(key))?;
        self.of_this_process(key, *made)?;
        Ok(v.clone())
    }

    /// Removes the handle; `Ok(None)` for NULL, which destroy accepts. A
    /// forked child's parent's objects stay (refused, and never dropped there).
    pub fn remove(&self, key: usize) -> Result<Option<Arc<T>>> {
        if key == 0 {
            return Ok(None);
        }
        let mut live = lock(&self.live);
        let (made, _) = live.get(&key).ok_or_else(|| self.unknown(key))?;
        self.of_this_process(key, *made)?;
        Ok(live.remove(&key).map(|(_, v)| v))
    }

    fn of_this_process(&self, key: usize, made: usize) -> Result<()> {
        if made == FORKS.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(err!(
            InvalidHandle,
            "{key:#x} is a {} of the process this one was forked from; a forked process forms its own group",
            self.what
        ))
    }

    fn unknown(&self, key: usize) -> crate::error::Error {
        err!(
            InvalidHandle,
            "{key:#x} is not a live {} (destroyed, never created, or another kind of handle)",
            self.what
        )
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.live).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_null_and_foreign_handles_are_reported() {
        static A: Registry<u32> = Registry::new(1, "symm_a_t");
        static B: Registry<u32> = Registry::new(2, "symm_b_t");
        let k = A.insert(Arc::new(5));
        assert_eq!(*A.get(k).unwrap(), 5);
        assert!(B.get(k).unwrap_err().msg.contains("not a live symm_b_t"));
        assert!(A.get(0).unwrap_err().msg.contains("NULL"));
        assert!(A.remove(k).unwrap().is_some());
        assert!(A.get(k).is_err());
        assert!(A.remove(k).is_err());
        assert!(A.remove(0).unwrap().is_none());
        assert_eq!(A.len(), 0);
    }

    /// In a forked child the parent's objects are refused, by get and by
    /// remove (which keeps them: their drop would act on the parent's
    /// sockets), while objects the child makes work.
    #[test]
    fn a_forked_child_refuses_its_parents_objects() {
        static C: Registry<u32> = Registry::new(3, "symm_c_t");
        let k = C.insert(Arc::new(7));
        // SAFETY: the child touches only `C` (this test's alone, so no lock
        // another thread held at the fork) and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let parents =
                C.get(k).is_err_and(|e| e.msg.contains("forked from")) && C.remove(k).is_err() && C.len() == 1;
            let own = C.insert(Arc::new(8));
            let ok = parents && C.get(own).is_ok_and(|v| *v == 8) && C.remove(own).is_ok();
            // SAFETY: ends the child without running the parent's atexit work.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child's checks failed: {status}");
        assert_eq!(*C.get(k).unwrap(), 7, "the parent keeps its object");
        C.remove(k).unwrap();
    }
}
