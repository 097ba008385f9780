//! Symmetric buffers, rendezvous, peer pointers and signals.

use super::args::{non_negative, out_ptr, write};
use super::boundary::call;
use super::handles::Registry;
use super::types::*;
use crate::backend::{CallTag, Stream};
use crate::buffer::{self, Buffer, Handle};
use crate::error::Result;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

static BUFFERS: Registry<Buffer> = Registry::new(0x2, "symm_buffer_t");
static HANDLES: Registry<Handle> = Registry::new(0x3, "symm_handle_t");

fn handle(h: symm_handle_t) -> Result<Arc<Handle>> {
    HANDLES.get(h as usize)
}

/// Allocates `bytes` of symmetric memory on this rank (not collective; every
/// rank allocates the same size, then calls `symm_rendezvous`). The memory is
/// zeroed. On CUDA it is device memory of the group's device.
#[no_mangle]
pub extern "C" fn symm_create(group: symm_group_t, bytes: usize, buffer: *mut symm_buffer_t) -> symm_status_t {
    call("symm_create", || {
        let out = out_ptr(buffer, "buffer")?;
        let b = Buffer::create(&super::group::group(group)?, bytes)?;
        write(out, BUFFERS.insert(b) as symm_buffer_t);
        Ok(())
    })
}

/// This rank's data pointer (device pointer on CUDA).
#[no_mangle]
pub extern "C" fn symm_buffer_ptr(buffer: symm_buffer_t, ptr: *mut *mut c_void) -> symm_status_t {
    call("symm_buffer_ptr", || {
        let out = out_ptr(ptr, "ptr")?;
        write(out, BUFFERS.get(buffer as usize)?.addr() as *mut c_void);
        Ok(())
    })
}

/// The size the buffer was created with.
#[no_mangle]
pub extern "C" fn symm_buffer_size(buffer: symm_buffer_t, bytes: *mut usize) -> symm_status_t {
    call("symm_buffer_size", || {
        let out = out_ptr(bytes, "bytes")?;
        write(out, BUFFERS.get(buffer as usize)?.size());
        Ok(())
    })
}

/// Releases this rank's reference. The memory lives on while a handle of it
/// exists here, and while peers still map it. NULL is accepted.
#[no_mangle]
pub extern "C" fn symm_buffer_destroy(buffer: symm_buffer_t) -> symm_status_t {
    call("symm_buffer_destroy", || BUFFERS.remove(buffer as usize).map(drop))
}

/// Collective over the buffer's group: maps every rank's buffer into this
/// process (in a group spanning hosts, those of the ranks on this host).
/// Fails on every rank if the ranks' sizes differ.
#[no_mangle]
pub extern "C" fn symm_rendezvous(buffer: symm_buffer_t, handle: *mut symm_handle_t) -> symm_status_t {
    call("symm_rendezvous", || {
        let out = out_ptr(handle, "handle")?;
        let h = buffer::rendezvous(&BUFFERS.get(buffer as usize)?)?;
        write(out, HANDLES.insert(h) as symm_handle_t);
        Ok(())
    })
}

/// Where rank `rank`'s buffer is mapped in this process (this rank's own
/// data pointer for `rank` = own rank). `SYMM_ERROR_UNSUPPORTED` for a rank
/// on another host: its memory is not mapped here.
#[no_mangle]
pub extern "C" fn symm_handle_peer_ptr(handle: symm_handle_t, rank: c_int, ptr: *mut *mut c_void) -> symm_status_t {
    call("symm_handle_peer_ptr", || {
        let out = out_ptr(ptr, "ptr")?;
        let addr = self::handle(handle)?.peer_addr(non_negative(rank, "rank")?)?;
        write(out, addr as *mut c_void);
        Ok(())
    })
}

/// Where rank `rank`'s signal pad (`uint32_t pad[16][world]`) is mapped
/// (`SYMM_ERROR_UNSUPPORTED` for a rank on another host).
#[no_mangle]
pub extern "C" fn symm_handle_signal_pad_ptr(
    handle: symm_handle_t,
    rank: c_int,
    ptr: *mut *mut c_void,
) -> symm_status_t {
    call("symm_handle_signal_pad_ptr", || {
        let out = out_ptr(ptr, "ptr")?;
        let addr = self::handle(handle)?.pad_addr(non_negative(rank, "rank")?)?;
        write(out, addr as *mut c_void);
        Ok(())
    })
}

/// Unmaps the peers' buffers. NULL is accepted.
#[no_mangle]
pub extern "C" fn symm_handle_destroy(handle: symm_handle_t) -> symm_status_t {
    call("symm_handle_destroy", || HANDLES.remove(handle as usize).map(drop))
}

/// Stream-ordered barrier of all ranks on `channel` (0..15): memory written
/// before it by any rank is visible to every rank after it. In a group
/// spanning hosts, of the ranks on this host (signals, too, reach only
/// them).
#[no_mangle]
pub extern "C" fn symm_barrier(handle: symm_handle_t, channel: c_int, stream: *mut c_void) -> symm_status_t {
    call("symm_barrier", || {
        self::handle(handle)?.barrier(non_negative(channel, "channel")?, CallTag::USER, Stream(stream as usize))
    })
}

/// Stream-ordered: signals `peer` on `channel`, releasing this rank's
/// earlier writes to it. Waits for the peer to consume a previous signal.
#[no_mangle]
pub extern "C" fn symm_put_signal(
    handle: symm_handle_t,
    peer: c_int,
    channel: c_int,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_put_signal", || {
        self::handle(handle)?.put_signal(
            non_negative(peer, "peer")?,
            non_negative(channel, "channel")?,
            CallTag::USER,
            Stream(stream as usize),
        )
    })
}

/// Stream-ordered: waits for `peer`'s signal on `channel` and consumes it.
#[no_mangle]
pub extern "C" fn symm_wait_signal(
    handle: symm_handle_t,
    peer: c_int,
    channel: c_int,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_wait_signal", || {
        self::handle(handle)?.wait_signal(
            non_negative(peer, "peer")?,
            non_negative(channel, "channel")?,
            CallTag::USER,
            Stream(stream as usize),
        )
    })
}

/// Stream-ordered: after the stream's earlier work, sets the `uint32_t` at
/// byte `offset` of rank `rank`'s buffer to `value` (a progress flag).
#[no_mangle]
pub extern "C" fn symm_write_value(
    handle: symm_handle_t,
    rank: c_int,
    offset: usize,
    value: u32,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_write_value", || {
        self::handle(handle)?.write_value(non_negative(rank, "rank")?, offset, value, Stream(stream as usize))
    })
}

/// Stream-ordered: the stream waits until the `uint32_t` at byte `offset` of
/// rank `rank`'s buffer is >= `value` (acquire), or the group's timeout
/// passes (then `symm_group_check_async_error` reports it on CUDA; the host
/// backend returns `SYMM_ERROR_TIMEOUT` at once).
#[no_mangle]
pub extern "C" fn symm_wait_value(
    handle: symm_handle_t,
    rank: c_int,
    offset: usize,
    value: u32,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_wait_value", || {
        self::handle(handle)?.wait_value(non_negative(rank, "rank")?, offset, value, Stream(stream as usize))
    })
}
