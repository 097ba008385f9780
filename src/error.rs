//! The crate's one error type. Every fallible function returns `Result<T>`;
//! the FFI layer maps `ErrorKind` onto `symm_status_t` and keeps the message
//! as the thread's last-error text.

use std::fmt;

/// What went wrong, coarse enough for a caller to branch on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An argument is malformed (NULL, out of range, wrong shape...).
    InvalidArgument,
    /// A handle is NULL, destroyed, or of another type.
    InvalidHandle,
    /// The request is valid but this build, backend or device cannot do it.
    Unsupported,
    /// A peer did not arrive in time; the message names it.
    Timeout,
    /// Ranks could not find or talk to each other.
    Bootstrap,
    /// Ranks passed arguments that disagree (sizes, shapes, world size...).
    Mismatch,
    /// An allocation failed.
    OutOfMemory,
    /// The CUDA driver or a CUDA library returned an error.
    Cuda,
    /// No CUDA driver, or the requested device does not exist.
    NoDevice,
    /// An operating-system call failed.
    System,
    /// Another rank failed the collective this rank took part in.
    Remote,
    /// A bug in symm (a caught panic, a broken invariant).
    Internal,
    /// The group failed earlier (on this rank or a peer) or was aborted,
    /// and refuses every operation until it is destroyed.
    Aborted,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub msg: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Error { kind, msg: msg.into() }
    }

    /// Wrap the current `errno` with what we were doing.
    pub fn last_os(what: impl fmt::Display) -> Self {
        Self::os(what, std::io::Error::last_os_error())
    }

    /// An operating-system error; ENOMEM (an mmap or memfd too large for
    /// the machine) is `OutOfMemory`, as callers test for it.
    pub fn os(what: impl fmt::Display, e: std::io::Error) -> Self {
        let kind = match e.raw_os_error() {
            Some(libc::ENOMEM) => ErrorKind::OutOfMemory,
            _ => ErrorKind::System,
        };
        Error::new(kind, format!("{what}: {e}"))
    }

    /// Prefix the message with context, keeping the kind.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.msg)
    }
}

impl std::error::Error for Error {}

/// Shorthand constructors, so call sites read like the condition they report.
macro_rules! err {
    ($kind:ident, $($arg:tt)*) => {
        $crate::error::Error::new($crate::error::ErrorKind::$kind, format!($($arg)*))
    };
}
pub(crate) use err;

/// `ensure!(cond, Kind, "fmt", args)` returns the error when `cond` is false.
macro_rules! ensure {
    ($cond:expr, $kind:ident, $($arg:tt)*) => {
        if !($cond) {
            return Err($crate::error::err!($kind, $($arg)*));
        }
    };
}
pub(crate) use ensure;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enomem_is_out_of_memory() {
        let e = Error::os("mmap of 4 EiB", std::io::Error::from_raw_os_error(libc::ENOMEM));
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(e.msg.starts_with("mmap of 4 EiB: "), "{}", e.msg);
        assert_eq!(Error::os("open", std::io::Error::from_raw_os_error(libc::EACCES)).kind, ErrorKind::System);
    }
}
