//! Opaque handles. A handle's value is a key into a per-type registry, never
//! a pointer we dereference: a destroyed, forged or wrong-type handle is
//! reported as `SYMM_ERROR_INVALID_HANDLE` instead of crashing, and a call
//! racing with destroy keeps its object alive through the `Arc` it got.

use crate::error::{err, Result};
use crate::sync::lock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct Registry<T> {
    /// Low bits of every key of this registry, so keys of different types
    /// never collide.
    tag: usize,
    what: &'static str,
    next: AtomicUsize,
    live: Mutex<BTreeMap<usize, Arc<T>>>,
}

const TAG_BITS: u32 = 4;

impl<T> Registry<T> {
    pub const fn new(tag: usize, what: &'static str) -> Self {
        Registry { tag, what, next: AtomicUsize::new(1), live: Mutex::new(BTreeMap::new()) }
    }

    pub fn insert(&self, v: Arc<T>) -> usize {
        // Keys are never reused, so a stale handle cannot alias a new object.
        let key = (self.next.fetch_add(1, Ordering::Relaxed) << TAG_BITS) | self.tag;
        lock(&self.live).insert(key, v);
        key
    }

    pub fn get(&self, key: usize) -> Result<Arc<T>> {
        if key == 0 {
            return Err(err!(InvalidHandle, "{} is NULL", self.what));
        }
        lock(&self.live).get(&key).cloned().ok_or_else(|| self.unknown(key))
    }

    /// Removes the handle; `Ok(None)` for NULL, which destroy accepts.
    pub fn remove(&self, key: usize) -> Result<Option<Arc<T>>> {
        if key == 0 {
            return Ok(None);
        }
        lock(&self.live).remove(&key).map(Some).ok_or_else(|| self.unknown(key))
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
}
