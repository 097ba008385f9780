//! Helpers for the operations' tests: in-process groups on the host
//! backend, driven one thread per rank.

use crate::backend::BackendChoice;
use crate::group::{Group, GroupConfig};
use std::sync::Arc;
use std::time::Duration;

pub fn host_config(check_args_always: bool) -> GroupConfig {
    GroupConfig {
        backend: Some(BackendChoice::Host),
        timeout: Some(Duration::from_secs(10)),
        check_args_always,
        ..Default::default()
    }
}

/// The facts of a host group of `world` ranks (no fused kernel).
pub fn host_facts(world: usize) -> crate::ops::decide::Facts {
    crate::ops::decide::Facts {
        caps: crate::backend::Capabilities::default(),
        world,
        own_devices: false,
        setting: None,
    }
}

pub fn host_groups(world: usize) -> Vec<Arc<Group>> {
    Group::new_local(&vec![0; world], &host_config(false)).unwrap()
}

/// The world of the GPU tests: `SYMM_TEST_WORLD` ranks, one per GPU
/// (default 2), so a four-GPU machine runs them at world 4.
pub fn gpu_test_world() -> usize {
    static WORLD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WORLD.get_or_init(crate::config::tests_env::test_world)
}

/// The calls' count in this rank's all-reduce buffer (the LL lines' and
/// the all-reduce's call numbers), or `None` when the group has none.
/// Host backend only: it reads the buffer as host memory.
pub fn lines_calls(g: &Group) -> Option<u32> {
    lines_buffer(g).map(|(_, calls)| calls)
}

/// [`lines_calls`] with the buffer's rendezvous id: a grown buffer counts
/// from 0 again.
pub fn lines_buffer(g: &Group) -> Option<(u64, u32)> {
    let h = crate::ops::state::of(g).scratch(crate::ops::state::Scratch::AllReduce)?;
    // SAFETY: the buffer's first word is the count, and no call runs.
    Some((h.id(), unsafe { *(h.buffer().addr() as *const u32) }))
}

/// A CUDA group of `world` ranks on devices 0..world, or None (reported
/// as skipped) with fewer devices.
pub fn cuda_groups(world: usize) -> Option<Vec<Arc<Group>>> {
    if crate::backend::cuda::driver::device_count() < world {
        crate::backend::cuda::gpu_testing::report_skipped();
        return None;
    }
    let cfg = GroupConfig {
        backend: Some(BackendChoice::Cuda),
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    Some(Group::new_local(&(0..world as i32).collect::<Vec<_>>(), &cfg).expect("a CUDA group of one rank per GPU"))
}

/// Runs `f(rank, group)` on every rank at once and collects the results.
pub fn on_each<T: Send>(groups: &[Arc<Group>], f: impl Fn(usize, &Arc<Group>) -> T + Sync) -> Vec<T> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.iter().enumerate().map(|(r, g)| s.spawn(move || f(r, g))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Host-backend groups whose rank r is on pretend host `hosts[r]`.
pub fn on_hosts(hosts: &[&str]) -> Vec<Arc<Group>> {
    on_hosts_with(hosts, false)
}

/// As [`on_hosts`]; `always`: every call's arguments are checked.
pub fn on_hosts_with(hosts: &[&str], always: bool) -> Vec<Arc<Group>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = crate::bootstrap::local::local_bootstraps(hosts.len())
            .into_iter()
            .zip(hosts)
            .map(|(b, h)| {
                let cfg = GroupConfig { host_id: Some(h.to_string()), ..host_config(always) };
                s.spawn(move || Group::new(Box::new(b), 0, &cfg).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
