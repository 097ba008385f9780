//! Group formation, queries and destruction.

use super::args::{group_config, in_ref, non_negative, out_ptr, write};
use super::boundary::call;
use super::handles::Registry;
use super::types::*;
use crate::backend::{BackendKind, MAX_WORLD};
use crate::bootstrap::{env, tcp, unique_id::UniqueId, Bootstrap};
use crate::error::{err, Result};
use crate::group::{Group, GroupConfig};
use std::ffi::{c_char, c_int, CStr};
use std::sync::Arc;

pub(super) static GROUPS: Registry<Group> = Registry::new(0x1, "symm_group_t");

pub(super) fn group(g: symm_group_t) -> Result<Arc<Group>> {
    GROUPS.get(g as usize)
}

fn publish(g: Arc<Group>) -> symm_group_t {
    let _scope = g.log_scope();
    let devices: Vec<i32> = g.ranks().iter().map(|r| r.device).collect();
    log::info!("group formed: {} backend, world {}, devices {devices:?}", g.backend().kind().name(), g.world());
    GROUPS.insert(g) as symm_group_t
}

/// The boundary's `call`, with the logger set up first: forming a group
/// may log (bootstrap timeouts, the kernels' NVRTC compile).
fn call_logged(func: &str, f: impl FnOnce() -> Result<()>) -> symm_status_t {
    crate::logging::init();
    call(func, f)
}

/// Rank and world from C ints, checked.
fn rank_world(world_size: c_int, rank: c_int) -> Result<(usize, usize)> {
    let world = non_negative(world_size, "world_size")?;
    let rank = non_negative(rank, "rank")?;
    if world == 0 || rank >= world {
        return Err(err!(InvalidArgument, "rank {rank} is not in 0..world_size ({world})"));
    }
    Ok((rank, world))
}

fn form(bs: Box<dyn Bootstrap>, device: c_int, cfg: &GroupConfig, out: *mut symm_group_t) -> Result<()> {
    let g = Group::new(bs, device, cfg)?;
    write(out, publish(g));
    Ok(())
}

/// Starts an embedded bootstrap store in this process and describes it in
/// `id`, to be passed to every rank (including this one) for
/// `symm_group_init`. Listens on env `SYMM_BOOTSTRAP_ADDR`, else loopback.
/// An id serves one group: once all its ranks have joined and left, the
/// store forgets it.
#[no_mangle]
pub extern "C" fn symm_get_unique_id(id: *mut symm_unique_id_t) -> symm_status_t {
    call_logged("symm_get_unique_id", || unique_id_at(None, id))
}

/// As `symm_get_unique_id`, listening on `listen_addr` ("host:port",
/// "ip:port" or "ip"; port 0 or none picks a free one).
#[no_mangle]
pub unsafe extern "C" fn symm_get_unique_id_at(listen_addr: *const c_char, id: *mut symm_unique_id_t) -> symm_status_t {
    call_logged("symm_get_unique_id_at", || {
        let addr = in_ref(listen_addr, "listen_addr")?;
        // SAFETY: non-NULL; the caller promises a NUL-terminated string.
        let addr =
            unsafe { CStr::from_ptr(addr) }.to_str().map_err(|_| err!(InvalidArgument, "listen_addr is not UTF-8"))?;
        unique_id_at(Some(addr), id)
    })
}

fn unique_id_at(addr: Option<&str>, id: *mut symm_unique_id_t) -> Result<()> {
    let out = out_ptr(id, "id")?;
    let uid = tcp::create_unique_id(addr)?;
    write(out, symm_unique_id_t { internal: uid.0.map(|b| b as c_char) });
    Ok(())
}

/// Collective: forms a group of `world_size` ranks through the store named
/// by `id`. `device` is this rank's CUDA device. `cfg` may be NULL.
#[no_mangle]
pub unsafe extern "C" fn symm_group_init(
    group: *mut symm_group_t,
    world_size: c_int,
    rank: c_int,
    device: c_int,
    id: *const symm_unique_id_t,
    cfg: *const symm_group_config_t,
) -> symm_status_t {
    call_logged("symm_group_init", || {
        let out = out_ptr(group, "group")?;
        let (rank, world) = rank_world(world_size, rank)?;
        let uid = UniqueId::decode(&in_ref(id, "id")?.internal.map(|c| c as u8))?;
        let cfg = group_config(cfg)?;
        let bs = tcp::TcpBootstrap::connect(&uid, rank, world, cfg.resolved_timeout()?)?;
        form(Box::new(bs), device, &cfg, out)
    })
}

/// Collective: forms a group over the caller's own allgather (MPI, a
/// framework's store...). The callbacks run on the calling thread, inside
/// this and later collective symm calls of the group.
#[no_mangle]
pub unsafe extern "C" fn symm_group_init_bootstrap(
    group: *mut symm_group_t,
    world_size: c_int,
    rank: c_int,
    device: c_int,
    bootstrap: *const symm_bootstrap_t,
    cfg: *const symm_group_config_t,
) -> symm_status_t {
    call_logged("symm_group_init_bootstrap", || {
        let out = out_ptr(group, "group")?;
        let (rank, world) = rank_world(world_size, rank)?;
        let bs = super::callback::from_table(in_ref(bootstrap, "bootstrap")?, rank, world)?;
        let cfg = group_config(cfg)?;
        form(Box::new(bs), device, &cfg, out)
    })
}

/// Collective: forms a group from torchrun's environment (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK` = device, `MASTER_ADDR`, `MASTER_PORT`; rank 0
/// hosts the store). Ranks all on one host (`LOCAL_WORLD_SIZE` =
/// `WORLD_SIZE`, or a loopback `MASTER_ADDR`) meet on a Unix socket that
/// admits only this user's processes; across hosts, on TCP port
/// `SYMM_BOOTSTRAP_PORT` or `MASTER_PORT + 1`, admitting only ranks that
/// present `SYMM_BOOTSTRAP_SECRET`, which must then be set.
#[no_mangle]
pub unsafe extern "C" fn symm_group_init_env(
    group: *mut symm_group_t,
    cfg: *const symm_group_config_t,
) -> symm_status_t {
    call_logged("symm_group_init_env", || {
        let out = out_ptr(group, "group")?;
        let cfg = group_config(cfg)?;
        let (bs, info) = env::connect_env(cfg.resolved_timeout()?)?;
        let device = c_int::try_from(info.local_rank).map_err(|_| err!(InvalidArgument, "LOCAL_RANK is too large"))?;
        form(Box::new(bs), device, &cfg, out)
    })
}

/// Forms `n` groups in this process, one per rank, rank i on `devices[i]`
/// (`devices` may be NULL: rank i uses device i). Writes `groups[0..n]`.
/// `n` is 1 to 256, the largest group symm forms. Collectives of such
/// groups must then be called from n threads at once.
#[no_mangle]
pub unsafe extern "C" fn symm_group_init_local(
    groups: *mut symm_group_t,
    n: c_int,
    devices: *const c_int,
    cfg: *const symm_group_config_t,
) -> symm_status_t {
    call_logged("symm_group_init_local", || {
        let out = out_ptr(groups, "groups")?;
        let n = usize::try_from(n).ok().filter(|n| (1..=MAX_WORLD).contains(n)).ok_or_else(|| {
            err!(InvalidArgument, "n is {n}; expected 1 to {MAX_WORLD}, the largest group symm forms")
        })?;
        let devices: Vec<c_int> = if devices.is_null() {
            (0..n as c_int).collect()
        } else {
            // SAFETY: the caller promises `devices` holds n ints.
            unsafe { std::slice::from_raw_parts(devices, n) }.to_vec()
        };
        let cfg = group_config(cfg)?;
        let formed = Group::new_local(&devices, &cfg)?;
        for (r, g) in formed.into_iter().enumerate() {
            // SAFETY: the caller promises room for n handles.
            unsafe { out.add(r).write(publish(g)) };
        }
        Ok(())
    })
}

/// Releases this rank's reference to the group and frees its operations'
/// workspace, after waiting for the work issued on its device so far (which
/// may still use it). NULL is accepted. Buffers and handles of the group
/// stay valid until they are destroyed.
#[no_mangle]
pub extern "C" fn symm_group_destroy(group: symm_group_t) -> symm_status_t {
    call("symm_group_destroy", || {
        if let Some(g) = GROUPS.remove(group as usize)? {
            g.release_scratch();
        }
        Ok(())
    })
}

fn query<T>(g: symm_group_t, out: *mut T, name: &str, f: impl FnOnce(&Group) -> T) -> Result<()> {
    let out = out_ptr(out, name)?;
    let g = group(g)?;
    write(out, f(&g));
    Ok(())
}

#[no_mangle]
pub extern "C" fn symm_group_rank(group: symm_group_t, rank: *mut c_int) -> symm_status_t {
    call("symm_group_rank", || query(group, rank, "rank", |g| g.rank() as c_int))
}

#[no_mangle]
pub extern "C" fn symm_group_world_size(group: symm_group_t, world_size: *mut c_int) -> symm_status_t {
    call("symm_group_world_size", || query(group, world_size, "world_size", |g| g.world() as c_int))
}

/// The CUDA device of this rank, or -1 on the host backend.
#[no_mangle]
pub extern "C" fn symm_group_device(group: symm_group_t, device: *mut c_int) -> symm_status_t {
    call("symm_group_device", || query(group, device, "device", |g| g.device()))
}

/// The backend the group resolved to (`SYMM_BACKEND_CUDA` or `SYMM_BACKEND_HOST`).
#[no_mangle]
pub extern "C" fn symm_group_backend(group: symm_group_t, backend: *mut symm_backend_t) -> symm_status_t {
    call("symm_group_backend", || {
        query(group, backend, "backend", |g| match g.backend().kind() {
            BackendKind::Cuda => SYMM_BACKEND_CUDA,
            BackendKind::Host => SYMM_BACKEND_HOST,
        })
    })
}

/// Sets how long this rank waits for its peers (in collectives and signal
/// waits) from now on, in milliseconds (> 0).
#[no_mangle]
pub extern "C" fn symm_group_set_timeout(group: symm_group_t, timeout_ms: c_int) -> symm_status_t {
    call("symm_group_set_timeout", || {
        let ms = non_negative(timeout_ms, "timeout_ms")?;
        self::group(group)?.set_timeout(std::time::Duration::from_millis(ms as u64))
    })
}

/// Reports a failure that happened asynchronously on the device (a signal
/// wait that timed out inside a kernel), as `SYMM_ERROR_TIMEOUT` naming the
/// peer, and fails the group (see `symm_group_health`). Returns
/// `SYMM_SUCCESS` when none happened.
#[no_mangle]
pub extern "C" fn symm_group_check_async_error(group: symm_group_t) -> symm_status_t {
    call("symm_group_check_async_error", || group_check(group))
}

fn group_check(g: symm_group_t) -> Result<()> {
    group(g)?.check_async_error()
}

/// Aborts the group on this rank: operations of the group blocked in a
/// wait on any thread of this rank end with `SYMM_ERROR_ABORTED`, work it
/// queued on the device stops waiting, the peers' waits end with
/// `SYMM_ERROR_REMOTE` naming this rank, and every later operation of the
/// group on every rank returns `SYMM_ERROR_ABORTED`. Returns at once; safe
/// to call from any thread, also while another thread is blocked in a
/// call of this group (as `ncclCommAbort`). An exchange already under way
/// through the bootstrap (a call's first agreement, a rendezvous) still
/// ends only at its timeout, with `SYMM_ERROR_TIMEOUT`. The group must
/// still be destroyed; a new one can be formed at once.
#[no_mangle]
pub extern "C" fn symm_group_abort(group: symm_group_t) -> symm_status_t {
    call("symm_group_abort", || {
        self::group(group)?.abort();
        Ok(())
    })
}

/// The group's health, in the style of `ncclCommGetAsyncError`: writes
/// `SYMM_SUCCESS` to `*health` while the group works, else the status of
/// its first failure, on this rank or a peer: `SYMM_ERROR_TIMEOUT`,
/// `SYMM_ERROR_REMOTE` (a peer failed; the text names it),
/// `SYMM_ERROR_ABORTED` (`symm_group_abort`), `SYMM_ERROR_CUDA`... From
/// then on every operation of the group returns `SYMM_ERROR_ABORTED`.
/// When the group failed, `symm_last_error()` then describes the failure.
/// A group fails at a timeout, at an exchange with the peers that was
/// lost, when an operation fails after it started moving data, when a
/// rank fails a call the ranks had agreed on while a peer went ahead with
/// it (see `symm_group_reserve_workspace`), at an asynchronous
/// device error, and at `symm_group_abort`; never for an argument every
/// rank was told about (those fail the one call). Returns an error only
/// for a bad handle or a NULL `health`.
#[no_mangle]
pub extern "C" fn symm_group_health(group: symm_group_t, health: *mut symm_status_t) -> symm_status_t {
    call("symm_group_health", || {
        let out = out_ptr(health, "health")?;
        let status = match self::group(group)?.failure() {
            None => SYMM_SUCCESS,
            Some(e) => {
                super::boundary::describe("symm_group_health", &e.msg);
                super::boundary::status_of(e.kind)
            }
        };
        write(out, status);
        Ok(())
    })
}
