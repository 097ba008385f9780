//! Adapts a caller's `symm_bootstrap_t` function table to the
//! [`Bootstrap`](crate::bootstrap::Bootstrap) contract.

use super::types::symm_bootstrap_t;
use crate::bootstrap::callback::CallbackBootstrap;
use crate::error::{err, Result};
use std::ffi::c_void;

/// The caller's context pointer. symm calls the callbacks only from inside
/// the symm call that needs them, on the caller's thread, so sending the
/// pointer along is the caller's own threading.
#[derive(Clone, Copy)]
struct Ctx(*mut c_void);
// SAFETY: see above; the header documents that callbacks run on the thread
// that called into symm.
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

pub fn from_table(t: &symm_bootstrap_t, rank: usize, world: usize) -> Result<CallbackBootstrap> {
    let min = std::mem::offset_of!(symm_bootstrap_t, barrier) + std::mem::size_of::<usize>();
    if t.struct_size < min {
        return Err(err!(
            InvalidArgument,
            "bootstrap->struct_size is {}; set it to sizeof(symm_bootstrap_t)",
            t.struct_size
        ));
    }
    super::args::at_most_max(t.struct_size, "bootstrap", &"set it to sizeof(symm_bootstrap_t)")?;
    let allgather = t.allgather.ok_or_else(|| err!(InvalidArgument, "bootstrap->allgather is NULL"))?;
    let ctx = Ctx(t.ctx);
    let ag = move |send: &[u8], recv: &mut [u8]| -> Result<()> {
        let ctx = ctx;
        // SAFETY: the caller's function, with buffers of the documented sizes.
        let rc = unsafe { allgather(ctx.0, send.as_ptr().cast(), recv.as_mut_ptr().cast(), send.len()) };
        if rc == 0 {
            Ok(())
        } else {
            Err(err!(Bootstrap, "the bootstrap allgather callback returned {rc}"))
        }
    };
    // `t.barrier` may be set; symm never calls it (see its documentation).
    Ok(CallbackBootstrap::new(rank, world, Box::new(ag)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::Bootstrap;
    use std::ffi::c_int;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    static BARRIERS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn copy(_: *mut c_void, send: *const c_void, recv: *mut c_void, bytes: usize) -> c_int {
        // SAFETY: world 1: `recv` holds `bytes` bytes, as `send` does.
        unsafe { std::ptr::copy_nonoverlapping(send.cast::<u8>(), recv.cast::<u8>(), bytes) };
        0
    }

    unsafe extern "C" fn barrier(_: *mut c_void) -> c_int {
        BARRIERS.fetch_add(1, Ordering::SeqCst);
        1
    }

    /// A table with a barrier callback (older callers set one) is accepted,
    /// and the barrier is never called.
    #[test]
    fn barrier_callback_accepted_and_unused() {
        let t = symm_bootstrap_t {
            struct_size: std::mem::size_of::<symm_bootstrap_t>(),
            ctx: std::ptr::null_mut(),
            allgather: Some(copy),
            barrier: Some(barrier),
        };
        let bs = from_table(&t, 0, 1).unwrap();
        assert_eq!(bs.allgather(b"abc", Duration::from_secs(1)).unwrap(), b"abc");
        assert_eq!(BARRIERS.load(Ordering::SeqCst), 0);
    }
}
