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
    let barrier = t.barrier.map(|b| {
        Box::new(move || -> Result<()> {
            let ctx = ctx;
            // SAFETY: the caller's function with its own context.
            let rc = unsafe { b(ctx.0) };
            if rc == 0 {
                Ok(())
            } else {
                Err(err!(Bootstrap, "the bootstrap barrier callback returned {rc}"))
            }
        }) as Box<dyn Fn() -> Result<()> + Send + Sync>
    });
    Ok(CallbackBootstrap::new(rank, world, Box::new(ag), barrier))
}
