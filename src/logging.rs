//! symm's logger: one line per event, behind the `log` crate facade (code
//! anywhere in the crate writes `log::info!(...)`, `log::warn!(...)`).
//!
//! Configured from the environment, read once, at the first [`init`]:
//!
//! * `SYMM_DEBUG`: `WARN`, `INFO`, `DEBUG` or `TRACE` (any case; `ERROR`
//!   too) shows events of that level and above; unset, empty or `OFF` shows
//!   none. Another value is reported in one warning line and read as `WARN`.
//! * `SYMM_DEBUG_FILE`: a file to append the lines to instead of stderr;
//!   `%h` is replaced by the host name, `%p` by the process id and `%%` by
//!   `%` (as `NCCL_DEBUG_FILE`), so ranks can each write their own file.
//!
//! A line reads `symm[<host>:<pid>] <LEVEL> g<group>:r<rank>/<world>
//! <module>: <message>`; the group part comes from the calling thread's
//! [`GroupScope`] and is left out outside one. A sink set by [`set_sink`]
//! (the C API's `symm_set_log_callback`) receives the lines instead of the
//! file or stderr.
//!
//! Cheap when off: the facade's macros test one atomic (`log::max_level`)
//! before formatting anything. Never panics into the caller, and an event
//! raised from inside a sink (a callback that calls symm) is dropped rather
//! than recursing.

use crate::config::LogSettings;
use log::{Level, LevelFilter, Log, Metadata, Record};
use std::cell::Cell;
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::sync::{Arc, Mutex, Once, OnceLock, RwLock};

/// Where lines go when no sink is set.
enum Output {
    Stderr,
    File(Mutex<File>),
}

/// A replacement destination for formatted lines (no trailing newline).
/// Called from any thread that logs.
pub type Sink = Arc<dyn Fn(Level, &str) + Send + Sync>;

struct Logger;

static LOGGER: Logger = Logger;
static INIT: Once = Once::new();
static OUTPUT: OnceLock<Output> = OnceLock::new();
static PREFIX: OnceLock<String> = OnceLock::new();
static SINK: RwLock<Option<Sink>> = RwLock::new(None);

/// Longest message kept; a longer one (an NVRTC log) is cut, so that a
/// line stays one write.
const MAX_MESSAGE: usize = 16 << 10;

thread_local! {
    static SCOPE: Cell<Option<Scope>> = const { Cell::new(None) };
    static IN_SINK: Cell<bool> = const { Cell::new(false) };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Scope {
    group: u64,
    rank: usize,
    world: usize,
}

/// Reads the environment and installs the logger, once per process; later
/// calls cost one atomic load. Every C entry point that can lead to an
/// event calls it, as must Rust code using the crate directly.
pub fn init() {
    INIT.call_once(|| configure(&crate::config::logging()));
}

fn configure(env: &LogSettings) {
    let (level, bad_level) = match parse_level(env.debug.as_deref()) {
        Ok(l) => (l, None),
        Err(v) => (LevelFilter::Warn, Some(v)),
    };
    let _ = PREFIX.set(format!("symm[{}:{}]", hostname(), std::process::id()));
    let mut bad_file = None;
    let output = match env.debug_file.as_deref().filter(|p| !p.is_empty()) {
        None => Output::Stderr,
        Some(pattern) => {
            let path = expand_path(pattern, &hostname(), std::process::id());
            match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
                Ok(f) => Output::File(Mutex::new(f)),
                Err(e) => {
                    bad_file = Some(format!("SYMM_DEBUG_FILE: cannot open '{path}' ({e}); logging to stderr"));
                    Output::Stderr
                }
            }
        }
    };
    let _ = OUTPUT.set(output);
    // Fails when the program installed a logger of its own (symm used as a
    // Rust library): events then go to that logger, and its level stands
    // unless SYMM_DEBUG is set.
    if log::set_logger(&LOGGER).is_ok() || env.debug.is_some() {
        log::set_max_level(level);
    }
    if let Some(v) = bad_level {
        log::warn!("SYMM_DEBUG='{v}' is not one of OFF, WARN, INFO, DEBUG, TRACE; using WARN");
    }
    if let Some(m) = bad_file {
        log::warn!("{m}");
    }
}

/// `SYMM_DEBUG`'s value as a level: `Err(value)` when it names none.
pub fn parse_level(value: Option<&str>) -> Result<LevelFilter, String> {
    let Some(v) = value else { return Ok(LevelFilter::Off) };
    match v.trim().to_ascii_uppercase().as_str() {
        "" | "OFF" | "NONE" => Ok(LevelFilter::Off),
        "ERROR" => Ok(LevelFilter::Error),
        "WARN" | "WARNING" => Ok(LevelFilter::Warn),
        "INFO" => Ok(LevelFilter::Info),
        "DEBUG" => Ok(LevelFilter::Debug),
        "TRACE" => Ok(LevelFilter::Trace),
        _ => Err(v.to_string()),
    }
}

/// Sets the level from now on, over `SYMM_DEBUG`.
pub fn set_level(level: LevelFilter) {
    init();
    log::set_max_level(level);
}

/// Sends lines to `sink` instead of the file or stderr (`None`: back to
/// them). Returns once the sink replaced has returned on every other thread
/// (`emit` calls a clone of it outside the lock), so that the caller may
/// free what it captured; called from inside a sink, it cannot wait for
/// itself and does not wait.
pub fn set_sink(sink: Option<Sink>) {
    init();
    let old = std::mem::replace(&mut *SINK.write().unwrap_or_else(|p| p.into_inner()), sink);
    let Some(old) = old else { return };
    if IN_SINK.try_with(Cell::get).unwrap_or(true) {
        return;
    }
    while Arc::strong_count(&old) > 1 {
        std::thread::yield_now();
    }
    // Everything the callers did before dropping their clones happened
    // before this returns.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
}

/// `SYMM_DEBUG_FILE`'s pattern with `%h`, `%p` and `%%` replaced.
pub fn expand_path(pattern: &str, host: &str, pid: u32) -> String {
    let mut out = String::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        match (c, chars.clone().next()) {
            ('%', Some('h')) => out.push_str(host),
            ('%', Some('p')) => {
                let _ = write!(out, "{pid}");
            }
            ('%', Some('%')) => out.push('%'),
            _ => {
                out.push(c);
                continue;
            }
        }
        chars.next();
    }
    out
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer and its length are valid; gethostname NUL-terminates
    // names that fit, and we stop at the first NUL or the buffer's end.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "?".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The calling thread's group, rank and world in every line it logs while
/// the guard lives. Scopes nest: dropping the guard restores the outer one.
#[must_use = "the scope ends when the guard is dropped"]
pub struct GroupScope {
    outer: Option<Scope>,
}

impl GroupScope {
    pub fn enter(group_id: u64, rank: usize, world: usize) -> GroupScope {
        init();
        let scope = Scope { group: group_id, rank, world };
        GroupScope { outer: SCOPE.try_with(|s| s.replace(Some(scope))).unwrap_or(None) }
    }
}

impl Drop for GroupScope {
    fn drop(&mut self) {
        let _ = SCOPE.try_with(|s| s.set(self.outer));
    }
}

/// A short id for a group in log lines, the same on every rank: 32 bits of
/// a hash of the secret all ranks of the group share.
pub fn group_id(secret: &[u8]) -> u64 {
    // A hash, not the secret's own bytes: log files are not secret.
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ("symm group id", secret).hash(&mut h);
    h.finish() & 0xffff_ffff
}

/// One event as a line, without a newline. Newlines inside the message
/// become ` | ` so that a line is an event.
fn format_line(prefix: &str, level: Level, scope: Option<Scope>, target: &str, message: &str) -> String {
    let mut line = String::with_capacity(prefix.len() + target.len() + message.len().min(MAX_MESSAGE) + 48);
    let _ = write!(line, "{prefix} {level} ");
    if let Some(s) = scope {
        let _ = write!(line, "g{:08x}:r{}/{} ", s.group, s.rank, s.world);
    }
    let target = target.strip_prefix("symm::").unwrap_or(target);
    let _ = write!(line, "{target}: ");
    let mut cut = message.len().min(MAX_MESSAGE);
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    let truncated = cut < message.len();
    line.push_str(&message[..cut].trim_end().replace('\n', " | "));
    if truncated {
        line.push_str(" ...");
    }
    line
}

impl Log for Logger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // Drop events raised while this thread is already in a sink.
        if IN_SINK.try_with(|f| f.replace(true)).unwrap_or(true) {
            return;
        }
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emit(record)));
        let _ = IN_SINK.try_with(|f| f.set(false));
    }

    fn flush(&self) {
        if let Some(Output::File(f)) = OUTPUT.get() {
            let _ = f.lock().map(|mut f| f.flush());
        }
    }
}

fn emit(record: &Record) {
    let message = match record.args().as_str() {
        Some(s) => std::borrow::Cow::Borrowed(s),
        None => std::borrow::Cow::Owned(record.args().to_string()),
    };
    let scope = SCOPE.try_with(Cell::get).unwrap_or(None);
    let prefix = PREFIX.get().map_or("symm", String::as_str);
    let line = format_line(prefix, record.level(), scope, record.target(), &message);
    // Clone the sink out of the lock: a callback may replace the sink.
    let sink = SINK.read().map(|s| s.clone()).unwrap_or(None);
    if let Some(sink) = sink {
        sink(record.level(), &line);
        return;
    }
    write_line(&line);
}

/// Writes a line with one write call, so lines of many threads and
/// processes do not interleave.
fn write_line(line: &str) {
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    match OUTPUT.get() {
        Some(Output::File(f)) => {
            if let Ok(mut f) = f.lock() {
                let _ = f.write_all(&bytes);
            }
        }
        _ => {
            let _ = std::io::stderr().write_all(&bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_in_any_case() {
        assert_eq!(parse_level(None), Ok(LevelFilter::Off));
        assert_eq!(parse_level(Some("")), Ok(LevelFilter::Off));
        assert_eq!(parse_level(Some("off")), Ok(LevelFilter::Off));
        assert_eq!(parse_level(Some("WARN")), Ok(LevelFilter::Warn));
        assert_eq!(parse_level(Some("warn")), Ok(LevelFilter::Warn));
        assert_eq!(parse_level(Some(" Info ")), Ok(LevelFilter::Info));
        assert_eq!(parse_level(Some("debug")), Ok(LevelFilter::Debug));
        assert_eq!(parse_level(Some("TRACE")), Ok(LevelFilter::Trace));
        assert_eq!(parse_level(Some("verbose")), Err("verbose".to_string()));
    }

    #[test]
    fn lines_carry_host_level_scope_and_module() {
        let scope = Scope { group: 0xab12, rank: 1, world: 4 };
        let line = format_line("symm[h:7]", Level::Info, Some(scope), "symm::backend::cuda::gemm", "algo 3");
        assert_eq!(line, "symm[h:7] INFO g0000ab12:r1/4 backend::cuda::gemm: algo 3");
        let line = format_line("symm[h:7]", Level::Warn, None, "symm::group", "two\nlines\n");
        assert_eq!(line, "symm[h:7] WARN group: two | lines");
        let long = "é".repeat(MAX_MESSAGE);
        let line = format_line("p", Level::Trace, None, "t", &long);
        assert!(line.len() < MAX_MESSAGE + 32 && line.ends_with(" ..."), "{}", line.len());
    }

    #[test]
    fn file_patterns_expand_host_and_pid() {
        assert_eq!(expand_path("/tmp/symm.%h.%p.log", "node1", 42), "/tmp/symm.node1.42.log");
        assert_eq!(expand_path("a%%p%", "h", 1), "a%p%");
        assert_eq!(expand_path("plain", "h", 1), "plain");
    }

    #[test]
    fn group_ids_come_from_the_shared_secret() {
        let secret = [0xde, 0xad, 0xbe, 0xef, 1, 2];
        assert_eq!(group_id(&secret), group_id(&secret.clone()));
        assert_ne!(group_id(&secret), group_id(&[0xde, 0xad, 0xbe, 0xef, 1, 3]));
        assert!(group_id(&secret) <= 0xffff_ffff);
    }

    #[test]
    fn scopes_nest_and_end_with_their_guard() {
        let now = || SCOPE.with(Cell::get);
        assert_eq!(now(), None);
        {
            let _a = GroupScope::enter(1, 0, 2);
            {
                let _b = GroupScope::enter(2, 1, 3);
                assert_eq!(now(), Some(Scope { group: 2, rank: 1, world: 3 }));
            }
            assert_eq!(now(), Some(Scope { group: 1, rank: 0, world: 2 }));
        }
        assert_eq!(now(), None);
    }

    /// The file sink, in a child process so that its environment is its
    /// own: the child runs `file_sink_child` with `SYMM_DEBUG_FILE` set.
    #[test]
    fn file_sink_gets_one_line_per_event() {
        let dir = std::env::temp_dir().join(format!("symm-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pattern = dir.join("log.%p.txt");
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "logging::tests::file_sink_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("SYMM_DEBUG", "info")
            .env("SYMM_DEBUG_FILE", &pattern)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files.len(), 1, "{files:?}");
        let text = std::fs::read_to_string(&files[0]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].starts_with("symm[") && lines[0].contains("] INFO g00000009:r0/2 logging::tests: first"));
        assert!(lines[1].contains("] WARN logging::tests: second | part"), "{text}");
        assert!(!text.contains("hidden"), "{text}");
    }

    #[test]
    #[ignore = "run by file_sink_gets_one_line_per_event"]
    fn file_sink_child() {
        init();
        {
            let _s = GroupScope::enter(9, 0, 2);
            log::info!("first");
        }
        log::warn!("second\npart");
        log::debug!("hidden");
    }
}
