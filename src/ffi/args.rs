//! Reading the caller's arguments: NULL checks, out-parameters written only
//! on success, and option structs read up to the size the caller compiled.

use super::types::*;
use crate::backend::BackendChoice;
use crate::error::{err, Result};
use crate::group::GroupConfig;
use std::time::Duration;

/// Checks an out-pointer is non-NULL before any work is done.
pub fn out_ptr<T>(p: *mut T, name: &str) -> Result<*mut T> {
    if p.is_null() {
        Err(err!(InvalidArgument, "{name} is NULL"))
    } else {
        Ok(p)
    }
}

/// Writes a result to a checked out-pointer.
pub fn write<T>(p: *mut T, v: T) {
    // SAFETY: `p` passed `out_ptr` and the caller promises it points to a T.
    unsafe { p.write(v) }
}

/// Borrows an input the caller passed by pointer.
pub fn in_ref<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: non-NULL, and the caller promises it points to a valid T for the call.
    unsafe { p.as_ref() }.ok_or_else(|| err!(InvalidArgument, "{name} is NULL"))
}

pub fn non_negative(v: i32, name: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| err!(InvalidArgument, "{name} is {v}; it must not be negative"))
}

pub fn backend_choice(b: symm_backend_t) -> Result<Option<BackendChoice>> {
    match b {
        SYMM_BACKEND_AUTO => Ok(None),
        SYMM_BACKEND_CUDA => Ok(Some(BackendChoice::Cuda)),
        SYMM_BACKEND_HOST => Ok(Some(BackendChoice::Host)),
        other => Err(err!(InvalidArgument, "backend {other} is not one of SYMM_BACKEND_AUTO/CUDA/HOST")),
    }
}

/// Reads a group config (NULL = defaults), honouring `struct_size` so that
/// callers compiled against an older, shorter struct keep working.
pub fn group_config(p: *const symm_group_config_t) -> Result<GroupConfig> {
    let mut cfg = GroupConfig::default();
    if p.is_null() {
        return Ok(cfg);
    }
    // SAFETY: `struct_size` is the first field of every version of the struct.
    let size = unsafe { std::ptr::read(p as *const usize) };
    let first = std::mem::offset_of!(symm_group_config_t, flags) + std::mem::size_of::<u32>();
    if size < first {
        return Err(err!(
            InvalidArgument,
            "config->struct_size is {size}; initialize the config with SYMM_GROUP_CONFIG_INIT"
        ));
    }
    // SAFETY: the caller's struct is at least as large as every field we read.
    let c = unsafe { &*p };
    cfg.backend = backend_choice(c.backend)?;
    cfg.timeout = match c.timeout_ms {
        0 => None,
        ms if ms > 0 => Some(Duration::from_millis(ms as u64)),
        ms => {
            return Err(err!(InvalidArgument, "config->timeout_ms is {ms}; use 0 for the default or a positive value"))
        }
    };
    let known = SYMM_GROUP_ALLOW_SHARED_DEVICE;
    if c.flags & !known != 0 {
        return Err(err!(InvalidArgument, "config->flags has unknown bits {:#x}", c.flags & !known));
    }
    cfg.allow_shared_device = c.flags & SYMM_GROUP_ALLOW_SHARED_DEVICE != 0;
    Ok(cfg)
}
