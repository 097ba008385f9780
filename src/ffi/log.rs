//! Logging and build queries: where symm's log lines go, at which level,
//! and how the library's kernels were built.
//!
//! Lines are written to stderr, or to the file env `SYMM_DEBUG_FILE` names
//! (`%h` = host name, `%p` = process id), at the level env `SYMM_DEBUG`
//! names (`WARN`, `INFO`, `DEBUG`, `TRACE` or `OFF`, any case; unset = off).
//! Both are read once, at the first symm call that may log.

use super::args::{out_ptr, out_struct_size};
use super::boundary::call;
use super::types::*;
use super::version::{SYMM_VERSION_MAJOR, SYMM_VERSION_MINOR, SYMM_VERSION_PATCH};
use crate::backend::cuda::kernels;
use crate::error::{err, Result};
use crate::logging;
use log::{Level, LevelFilter};
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Arc;

/// No events (`symm_set_log_level` only).
pub const SYMM_LOG_OFF: c_int = 0;
/// Failures symm also reports by status (a peer's timeout), and problems
/// it worked around.
pub const SYMM_LOG_WARN: c_int = 1;
/// One-off decisions: the group formed, the algorithm chosen, the kernels'
/// NVRTC compile, a refused graph capture, cuBLASLt's pick for a shape.
pub const SYMM_LOG_INFO: c_int = 2;
/// Every event: also those below INFO (a call captured as a CUDA graph).
pub const SYMM_LOG_TRACE: c_int = 3;

/// Receives each log line (formatted, without a newline; valid only during
/// the call) and its `SYMM_LOG_*` level. Called from any thread that logs,
/// possibly several at once; it must not block for long. Events that symm
/// raises while the callback runs on that thread are dropped.
pub type symm_log_callback_t = Option<unsafe extern "C" fn(ctx: *mut c_void, level: c_int, message: *const c_char)>;

/// How the loaded library was built. Set `struct_size` to
/// `sizeof(symm_build_info_t)` before the call; fields are only ever
/// appended, and those this library does not know are zeroed.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct symm_build_info_t {
    /// `sizeof(symm_build_info_t)` as the caller compiled it.
    pub struct_size: usize,
    /// `MAJOR * 10000 + MINOR * 100 + PATCH`, as `symm_get_version`.
    pub version_code: i32,
    /// "MAJOR.MINOR.PATCH" (static).
    pub version: *const c_char,
    /// "fatbin" (compiled by nvcc into the library) or "nvrtc" (compiled
    /// from the embedded sources on first use of each device). Static.
    pub kernels: *const c_char,
    /// One line on the kernels' build: the nvcc version and path, or
    /// "sources only (NVRTC at run time)". Static.
    pub kernels_build: *const c_char,
}

/// Routes symm's log lines to `callback` (with `ctx` passed back) instead
/// of stderr or `SYMM_DEBUG_FILE`; NULL restores those. The level stays
/// `SYMM_DEBUG`'s or `symm_set_log_level`'s: with neither, nothing is logged.
/// Returns once the callback replaced has returned on every other thread
/// (its `ctx` may then be freed); a callback may call this, and then does
/// not wait.
#[no_mangle]
pub extern "C" fn symm_set_log_callback(callback: symm_log_callback_t, ctx: *mut c_void) -> symm_status_t {
    call("symm_set_log_callback", || {
        logging::set_sink(callback.map(|cb| sink(cb, Ctx(ctx))));
        Ok(())
    })
}

/// Sets the level (`SYMM_LOG_OFF`, `_WARN`, `_INFO` or `_TRACE`) from now
/// on, over env `SYMM_DEBUG` (`WARN`, `INFO`, `DEBUG`, `TRACE` or `OFF`, any
/// case; unset = off), which is read at the first call that may log, with
/// env `SYMM_DEBUG_FILE` (a file to append lines to instead of stderr; `%h`
/// = host name, `%p` = process id). A line reads
/// `symm[host:pid] LEVEL g<group>:r<rank>/<world> <module>: <message>`.
#[no_mangle]
pub extern "C" fn symm_set_log_level(level: c_int) -> symm_status_t {
    call("symm_set_log_level", || {
        logging::set_level(level_filter(level)?);
        Ok(())
    })
}

/// Fills `info` (whose `struct_size` the caller set) with how the library
/// was built.
#[no_mangle]
pub unsafe extern "C" fn symm_get_build_info(info: *mut symm_build_info_t) -> symm_status_t {
    call("symm_get_build_info", || {
        let out = out_ptr(info, "info")?;
        let ours = std::mem::size_of::<symm_build_info_t>();
        let size = out_struct_size(out, "info", &format!("set it to sizeof(symm_build_info_t) ({ours})"))?;
        let filled = build_info(size);
        // SAFETY: the caller's struct holds `size` >= `ours` writable bytes;
        // a newer caller's fields beyond ours read as zero (unknown).
        unsafe {
            out.write(filled);
            std::ptr::write_bytes((out as *mut u8).add(ours), 0, size - ours);
        }
        Ok(())
    })
}

fn build_info(struct_size: usize) -> symm_build_info_t {
    static BUILD: std::sync::OnceLock<CString> = std::sync::OnceLock::new();
    let build = BUILD.get_or_init(|| CString::new(kernels::build_info()).unwrap_or_default());
    symm_build_info_t {
        struct_size,
        version_code: SYMM_VERSION_MAJOR * 10000 + SYMM_VERSION_MINOR * 100 + SYMM_VERSION_PATCH,
        version: concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast(),
        kernels: if kernels::fatbins().next().is_some() { c"fatbin" } else { c"nvrtc" }.as_ptr(),
        kernels_build: build.as_ptr(),
    }
}

fn level_filter(level: c_int) -> Result<LevelFilter> {
    match level {
        SYMM_LOG_OFF => Ok(LevelFilter::Off),
        SYMM_LOG_WARN => Ok(LevelFilter::Warn),
        SYMM_LOG_INFO => Ok(LevelFilter::Info),
        SYMM_LOG_TRACE => Ok(LevelFilter::Trace),
        other => Err(err!(InvalidArgument, "log level {other} is not one of SYMM_LOG_OFF/WARN/INFO/TRACE")),
    }
}

fn c_level(level: Level) -> c_int {
    match level {
        Level::Error | Level::Warn => SYMM_LOG_WARN,
        Level::Info => SYMM_LOG_INFO,
        Level::Debug | Level::Trace => SYMM_LOG_TRACE,
    }
}

/// The caller's context pointer: the header tells the caller the callback
/// runs on any thread, so handing it to other threads is the contract.
#[derive(Clone, Copy)]
struct Ctx(*mut c_void);
// SAFETY: see above.
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

fn sink(cb: unsafe extern "C" fn(*mut c_void, c_int, *const c_char), ctx: Ctx) -> logging::Sink {
    Arc::new(move |level: Level, line: &str| {
        let ctx = ctx;
        let line = CString::new(line.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the caller's function with its own context and a
        // NUL-terminated line that outlives the call.
        unsafe { cb(ctx.0, c_level(level), line.as_ptr()) };
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use std::sync::Mutex;

    static SEEN: Mutex<Vec<(c_int, String)>> = Mutex::new(Vec::new());
    /// Held by the tests that set the process's callback.
    static CALLBACK: Mutex<()> = Mutex::new(());

    unsafe extern "C" fn collect(ctx: *mut c_void, level: c_int, message: *const c_char) {
        assert_eq!(ctx as usize, 0x5eed);
        let line = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
        SEEN.lock().unwrap().push((level, line));
    }

    /// A bootstrap timeout, reported through a callback set by the C API
    /// (other tests' events may arrive too: look for ours).
    #[test]
    fn callback_receives_a_timeout_warning() {
        use crate::bootstrap::Bootstrap;
        let _one = CALLBACK.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(symm_set_log_callback(Some(collect), 0x5eed as *mut c_void), SYMM_SUCCESS);
        assert_eq!(symm_set_log_level(SYMM_LOG_INFO), SYMM_SUCCESS);
        let bs = crate::bootstrap::local::local_bootstraps(3);
        let e = bs[0].allgather(&[1], std::time::Duration::from_millis(5)).unwrap_err();
        {
            let _g = logging::GroupScope::enter(0x77, 0, 2);
            log::info!("an explicit event");
        }
        assert_eq!(symm_set_log_callback(None, std::ptr::null_mut()), SYMM_SUCCESS);
        assert_eq!(symm_set_log_level(SYMM_LOG_OFF), SYMM_SUCCESS);
        let seen = SEEN.lock().unwrap();
        let warn = seen.iter().find(|(_, l)| l.contains("ranks [1, 2] of 3 did not arrive")).expect("no timeout line");
        assert_eq!(warn.0, SYMM_LOG_WARN);
        assert!(warn.1.contains(" WARN ") && warn.1.contains(&e.msg) && !warn.1.ends_with('\n'), "{}", warn.1);
        let info = seen.iter().find(|(_, l)| l.contains("an explicit event")).expect("no info line");
        assert_eq!(info.0, SYMM_LOG_INFO);
        assert!(info.1.contains(" INFO g00000077:r0/2 ffi::log::tests: an explicit event"), "{}", info.1);
    }

    static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    static FINISHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    unsafe extern "C" fn slow(_ctx: *mut c_void, _level: c_int, _message: *const c_char) {
        use std::sync::atomic::Ordering::SeqCst;
        STARTED.store(true, SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(100));
        FINISHED.store(true, SeqCst);
    }

    /// Once the callback is replaced, the old one runs on no thread: the
    /// caller may free its context.
    #[test]
    fn replacing_the_callback_waits_for_calls_in_flight() {
        use std::sync::atomic::Ordering::SeqCst;
        let _one = CALLBACK.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(symm_set_log_callback(Some(slow), std::ptr::null_mut()), SYMM_SUCCESS);
        assert_eq!(symm_set_log_level(SYMM_LOG_WARN), SYMM_SUCCESS);
        let logger = std::thread::spawn(|| log::warn!("a line for the slow callback"));
        while !STARTED.load(SeqCst) {
            std::thread::yield_now();
        }
        assert_eq!(symm_set_log_callback(None, std::ptr::null_mut()), SYMM_SUCCESS);
        assert!(FINISHED.load(SeqCst), "the old callback was still running");
        assert_eq!(symm_set_log_level(SYMM_LOG_OFF), SYMM_SUCCESS);
        logger.join().unwrap();
    }

    #[test]
    fn bad_levels_are_rejected() {
        assert_eq!(symm_set_log_level(7), SYMM_ERROR_INVALID_ARGUMENT);
        assert_eq!(symm_set_log_level(-1), SYMM_ERROR_INVALID_ARGUMENT);
    }

    #[test]
    fn build_info_names_the_kernels_build() {
        let mut info: symm_build_info_t = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { symm_get_build_info(&mut info) }, SYMM_ERROR_INVALID_ARGUMENT);
        assert_eq!(unsafe { symm_get_build_info(std::ptr::null_mut()) }, SYMM_ERROR_INVALID_ARGUMENT);
        // A newer caller's longer struct: the unknown tail is zeroed.
        #[repr(C)]
        struct Newer {
            info: symm_build_info_t,
            extra: u64,
        }
        let mut newer: Newer = unsafe { std::mem::zeroed() };
        newer.info.struct_size = std::mem::size_of::<Newer>();
        newer.extra = 99;
        assert_eq!(unsafe { symm_get_build_info(&mut newer.info) }, SYMM_SUCCESS);
        assert_eq!(newer.extra, 0);
        let info = newer.info;
        assert_eq!(info.struct_size, std::mem::size_of::<Newer>());
        assert_eq!(info.version_code, 100);
        let s = |p: *const c_char| unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned();
        assert_eq!(s(info.version), env!("CARGO_PKG_VERSION"));
        let kernels = s(info.kernels);
        assert_eq!(kernels, if cfg!(symm_fatbin) { "fatbin" } else { "nvrtc" });
        assert_eq!(s(info.kernels_build), kernels::build_info());
    }
}
