//! The functions of XLA's API table that the handlers call: creating the
//! error they return, and asking the execution context for its stream and
//! device. Each checks that the table is new enough to have the function,
//! since a handler may be loaded by an older or newer XLA than the header
//! it was generated from.

use super::c_api::*;
use crate::error::{err, Error, ErrorKind, Result};
use std::ffi::c_void;
use std::mem::offset_of;

/// XLA's API table of one call.
#[derive(Clone, Copy)]
pub struct Api<'a>(pub &'a XLA_FFI_Api);

/// Whether a table of `struct_size` bytes has the field at `offset` of type `F`.
fn covers<F>(struct_size: usize, offset: usize) -> bool {
    struct_size >= offset + std::mem::size_of::<F>()
}

impl Api<'_> {
    /// Fails unless the table speaks the major version our header does
    /// (minor versions only append).
    pub fn check_version(&self) -> Result<()> {
        let v = &self.0.api_version;
        if v.major_version != XLA_FFI_API_MAJOR as i32 {
            return Err(err!(
                Unsupported,
                "XLA FFI API version {}.{}; symm's handlers are built for major version {XLA_FFI_API_MAJOR}",
                v.major_version,
                v.minor_version
            ));
        }
        Ok(())
    }

    /// An XLA error carrying `e`'s kind and message, owned by the caller
    /// (XLA, when a handler returns it). NULL only when the table has no
    /// way to make one.
    pub fn error(&self, e: &Error) -> *mut XLA_FFI_Error {
        let create = match self.0.XLA_FFI_Error_Create {
            Some(f)
                if covers::<XLA_FFI_Error_Create>(
                    self.0.struct_size,
                    offset_of!(XLA_FFI_Api, XLA_FFI_Error_Create),
                ) =>
            {
                f
            }
            _ => return std::ptr::null_mut(),
        };
        // XLA copies the message into its status; the CString lives past the call.
        let msg = std::ffi::CString::new(e.msg.replace('\0', " ")).unwrap_or_default();
        let mut args = XLA_FFI_Error_Create_Args {
            struct_size: XLA_FFI_Error_Create_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            message: msg.as_ptr(),
            errc: error_code(e.kind),
        };
        // SAFETY: a valid, fully initialized argument struct.
        unsafe { create(&mut args) }
    }

    /// The platform stream of the call (a `CUstream` on CUDA).
    pub fn stream(&self, ctx: *mut XLA_FFI_ExecutionContext) -> Result<*mut c_void> {
        let f = self.function(self.0.XLA_FFI_Stream_Get, offset_of!(XLA_FFI_Api, XLA_FFI_Stream_Get), "Stream_Get")?;
        let mut args = XLA_FFI_Stream_Get_Args {
            struct_size: XLA_FFI_Stream_Get_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: a valid argument struct; `ctx` is the frame's.
        self.check(unsafe { f(&mut args) }, "XLA_FFI_Stream_Get")?;
        Ok(args.stream)
    }

    /// The ordinal of the device the call runs on.
    pub fn device_ordinal(&self, ctx: *mut XLA_FFI_ExecutionContext) -> Result<i32> {
        let f = self.function(
            self.0.XLA_FFI_DeviceOrdinal_Get,
            offset_of!(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get),
            "DeviceOrdinal_Get",
        )?;
        let mut args = XLA_FFI_DeviceOrdinal_Get_Args {
            struct_size: XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            ctx,
            device_ordinal: -1,
        };
        // SAFETY: a valid argument struct; `ctx` is the frame's.
        self.check(unsafe { f(&mut args) }, "XLA_FFI_DeviceOrdinal_Get")?;
        Ok(args.device_ordinal)
    }

    fn function<F>(&self, f: Option<F>, offset: usize, name: &str) -> Result<F> {
        match f {
            Some(f) if covers::<Option<F>>(self.0.struct_size, offset) => Ok(f),
            _ => Err(err!(Unsupported, "this XLA's FFI API has no XLA_FFI_{name}; use a newer jaxlib")),
        }
    }

    /// Turns an error XLA returned into ours, destroying XLA's.
    fn check(&self, e: *mut XLA_FFI_Error, what: &str) -> Result<()> {
        if e.is_null() {
            return Ok(());
        }
        let mut msg = String::from("(no message)");
        if let Some(get) = self.0.XLA_FFI_Error_GetMessage {
            let mut args = XLA_FFI_Error_GetMessage_Args {
                struct_size: XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                error: e,
                message: std::ptr::null(),
            };
            // SAFETY: `e` is a live error; the message lives as long as it.
            unsafe { get(&mut args) };
            if !args.message.is_null() {
                // SAFETY: XLA returns a NUL-terminated string.
                msg = unsafe { std::ffi::CStr::from_ptr(args.message) }.to_string_lossy().into_owned();
            }
        }
        if let Some(destroy) = self.0.XLA_FFI_Error_Destroy {
            let mut args = XLA_FFI_Error_Destroy_Args {
                struct_size: XLA_FFI_Error_Destroy_Args_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                error: e,
            };
            // SAFETY: we own `e` and destroy it once.
            unsafe { destroy(&mut args) };
        }
        Err(err!(Internal, "{what} failed: {msg}"))
    }
}

/// The absl status code XLA reports for each kind of our errors.
pub fn error_code(kind: ErrorKind) -> XLA_FFI_Error_Code {
    match kind {
        ErrorKind::InvalidArgument => XLA_FFI_Error_Code_INVALID_ARGUMENT,
        ErrorKind::InvalidHandle | ErrorKind::Mismatch => XLA_FFI_Error_Code_FAILED_PRECONDITION,
        ErrorKind::Unsupported => XLA_FFI_Error_Code_UNIMPLEMENTED,
        ErrorKind::Timeout => XLA_FFI_Error_Code_DEADLINE_EXCEEDED,
        ErrorKind::Bootstrap | ErrorKind::NoDevice => XLA_FFI_Error_Code_UNAVAILABLE,
        ErrorKind::OutOfMemory => XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
        ErrorKind::Remote | ErrorKind::Aborted => XLA_FFI_Error_Code_ABORTED,
        ErrorKind::Cuda | ErrorKind::System | ErrorKind::Internal => XLA_FFI_Error_Code_INTERNAL,
    }
}
