//! Version and error-text queries.

use super::args::{out_ptr, write};
use super::boundary::{call, last_error_ptr};
use super::types::*;
use std::ffi::c_char;

pub const SYMM_VERSION_MAJOR: i32 = 0;
pub const SYMM_VERSION_MINOR: i32 = 1;
pub const SYMM_VERSION_PATCH: i32 = 0;

/// Writes the library's version as `MAJOR * 10000 + MINOR * 100 + PATCH`,
/// to compare with `SYMM_VERSION_CODE` from the header.
#[no_mangle]
pub extern "C" fn symm_get_version(version: *mut i32) -> symm_status_t {
    call("symm_get_version", || {
        let out = out_ptr(version, "version")?;
        write(out, SYMM_VERSION_MAJOR * 10000 + SYMM_VERSION_MINOR * 100 + SYMM_VERSION_PATCH);
        Ok(())
    })
}

/// A static, human-readable name for a status ("SYMM_ERROR_TIMEOUT").
#[no_mangle]
pub extern "C" fn symm_status_string(status: symm_status_t) -> *const c_char {
    let s: &'static std::ffi::CStr = match status {
        SYMM_SUCCESS => c"SYMM_SUCCESS",
        SYMM_ERROR_INVALID_ARGUMENT => c"SYMM_ERROR_INVALID_ARGUMENT",
        SYMM_ERROR_INVALID_HANDLE => c"SYMM_ERROR_INVALID_HANDLE",
        SYMM_ERROR_UNSUPPORTED => c"SYMM_ERROR_UNSUPPORTED",
        SYMM_ERROR_TIMEOUT => c"SYMM_ERROR_TIMEOUT",
        SYMM_ERROR_BOOTSTRAP => c"SYMM_ERROR_BOOTSTRAP",
        SYMM_ERROR_MISMATCH => c"SYMM_ERROR_MISMATCH",
        SYMM_ERROR_OUT_OF_MEMORY => c"SYMM_ERROR_OUT_OF_MEMORY",
        SYMM_ERROR_CUDA => c"SYMM_ERROR_CUDA",
        SYMM_ERROR_NO_DEVICE => c"SYMM_ERROR_NO_DEVICE",
        SYMM_ERROR_SYSTEM => c"SYMM_ERROR_SYSTEM",
        SYMM_ERROR_REMOTE => c"SYMM_ERROR_REMOTE",
        SYMM_ERROR_INTERNAL => c"SYMM_ERROR_INTERNAL",
        SYMM_ERROR_ABORTED => c"SYMM_ERROR_ABORTED",
        _ => c"SYMM_ERROR_UNKNOWN_STATUS",
    };
    s.as_ptr()
}

/// The message of the most recent failed symm call on this thread (empty if
/// none). Valid until the thread's next failing call.
#[no_mangle]
pub extern "C" fn symm_last_error() -> *const c_char {
    last_error_ptr()
}
