//! The panic and error boundary: every exported function runs its body
//! through [`call`], which turns `Err` and panics into a status code and
//! keeps the message for `symm_last_error`.

use super::types::*;
use crate::error::{Error, ErrorKind, Result};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub fn status_of(kind: ErrorKind) -> symm_status_t {
    match kind {
        ErrorKind::InvalidArgument => SYMM_ERROR_INVALID_ARGUMENT,
        ErrorKind::InvalidHandle => SYMM_ERROR_INVALID_HANDLE,
        ErrorKind::Unsupported => SYMM_ERROR_UNSUPPORTED,
        ErrorKind::Timeout => SYMM_ERROR_TIMEOUT,
        ErrorKind::Bootstrap => SYMM_ERROR_BOOTSTRAP,
        ErrorKind::Mismatch => SYMM_ERROR_MISMATCH,
        ErrorKind::OutOfMemory => SYMM_ERROR_OUT_OF_MEMORY,
        ErrorKind::Cuda => SYMM_ERROR_CUDA,
        ErrorKind::NoDevice => SYMM_ERROR_NO_DEVICE,
        ErrorKind::System => SYMM_ERROR_SYSTEM,
        ErrorKind::Remote => SYMM_ERROR_REMOTE,
        ErrorKind::Internal => SYMM_ERROR_INTERNAL,
        ErrorKind::Aborted => SYMM_ERROR_ABORTED,
    }
}

/// Runs `f`, converting its error or panic into a status. `func` names the
/// entry point in the message.
pub fn call(func: &str, f: impl FnOnce() -> Result<()>) -> symm_status_t {
    crate::logging::init();
    let result = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::new(ErrorKind::Internal, format!("panic inside symm: {what}")))
    });
    match result {
        Ok(()) => SYMM_SUCCESS,
        Err(e) => {
            set_last_error(&format!("{func}: {}", e.msg));
            status_of(e.kind)
        }
    }
}

/// Makes `msg` this thread's last-error text without failing the call
/// (a query that reports a failure as its result).
pub fn describe(func: &str, msg: &str) {
    set_last_error(&format!("{func}: {msg}"));
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; dropping the
    // message then is better than aborting.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = c);
}

/// Pointer to this thread's last message; valid until this thread's next
/// failing symm call.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR.try_with(|slot| slot.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::err;
    use std::ffi::CStr;

    #[test]
    fn panics_become_internal_errors() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let s = call("symm_test", || panic!("boom"));
        std::panic::set_hook(prev);
        assert_eq!(s, SYMM_ERROR_INTERNAL);
        let msg = unsafe { CStr::from_ptr(last_error_ptr()) }.to_str().unwrap();
        assert!(msg.contains("symm_test") && msg.contains("boom"), "{msg}");
    }

    #[test]
    fn errors_map_to_status_and_message() {
        assert_eq!(call("f", || Err(err!(Timeout, "rank 3 late"))), SYMM_ERROR_TIMEOUT);
        let msg = unsafe { CStr::from_ptr(last_error_ptr()) }.to_str().unwrap();
        assert_eq!(msg, "f: rank 3 late");
        assert_eq!(call("f", || Ok(())), SYMM_SUCCESS);
    }
}
