//! Which group a call on a given XLA device belongs to.
//!
//! One process may drive several devices (JAX's default on one host), and
//! XLA calls a handler once per device, so the handler finds its rank from
//! the device it runs on. `symm_xla_bind_device` (filled by `symm.jax` at
//! init) maps (platform, device ordinal) to a group handle. The handle, not
//! the group, is kept: destroying the group makes later calls on the device
//! fail with a message instead of keeping the group alive behind the
//! caller's back.

use crate::error::{err, Result};
use crate::ffi::types::symm_group_t;
use crate::group::Group;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The XLA platforms symm serves: the host backend under XLA's CPU
/// platform, the CUDA backend under its CUDA platform.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Platform {
    Cpu,
    Cuda,
}

impl Platform {
    pub fn name(self) -> &'static str {
        match self {
            Platform::Cpu => "cpu",
            Platform::Cuda => "cuda",
        }
    }
}

static BOUND: Mutex<Option<HashMap<(Platform, i32), usize>>> = Mutex::new(None);

fn bound() -> std::sync::MutexGuard<'static, Option<HashMap<(Platform, i32), usize>>> {
    // The map stays consistent even if a holder panicked.
    BOUND.lock().unwrap_or_else(|p| p.into_inner())
}

/// Binds the device to a group handle, or unbinds it (`group` NULL).
pub fn bind(platform: Platform, ordinal: i32, group: symm_group_t) -> Result<()> {
    if ordinal < 0 {
        return Err(err!(InvalidArgument, "device_ordinal is {ordinal}; it must not be negative"));
    }
    let mut map = bound();
    let map = map.get_or_insert_with(HashMap::new);
    if group.is_null() {
        map.remove(&(platform, ordinal));
    } else {
        // Fails for a destroyed or foreign handle now rather than at the first call.
        crate::ffi::group::group(group)?;
        map.insert((platform, ordinal), group as usize);
    }
    Ok(())
}

/// The group of the device, with this rank's position in it, and the
/// handle it is bound to (handles are never reused, so the handle names
/// one formation of the group).
pub fn lookup(platform: Platform, ordinal: i32) -> Result<(usize, Arc<Group>)> {
    let key = bound().as_ref().and_then(|m| m.get(&(platform, ordinal)).copied()).ok_or_else(|| {
        err!(
            InvalidArgument,
            "{} device {ordinal} is bound to no symm group; call symm.jax.init() (or symm_xla_bind_device) first",
            platform.name()
        )
    })?;
    let group = crate::ffi::group::group(key as symm_group_t)
        .map_err(|e| e.context(format!("{} device {ordinal}'s group (bind the device again)", platform.name())))?;
    Ok((key, group))
}
