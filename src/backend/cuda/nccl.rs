//! NCCL, loaded at run time like the driver (no link-time dependency), for
//! groups whose ranks are on different hosts: a machine without it gets a
//! clear `Unsupported`, never a crash.
//!
//! Search order: `SYMM_NCCL_LIBRARY` (only it, when set: a path the user
//! named that fails is reported, not replaced), then `libnccl.so.2`
//! through the dynamic loader (the system's, or the nvidia-nccl wheel's
//! when the Python package points `SYMM_NCCL_LIBRARY` at it).
//!
//! Every symbol is looked up before any is used; the library stays loaded
//! for the life of the process (NCCL keeps threads that must not outlive
//! its code).

use crate::array::DType;
use crate::config;
use crate::error::{err, Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::RwLock;

/// `ncclResult_t`: 0 is success.
type NcclResult = c_int;
/// `ncclComm_t`.
type RawComm = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; UniqueId::BYTES],
}

impl UniqueId {
    pub const BYTES: usize = 128;

    /// An id as another rank sent it.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let internal = b.try_into().map_err(|_| err!(Internal, "malformed NCCL unique id ({} bytes)", b.len()))?;
        Ok(UniqueId { internal })
    }
}

/// `ncclDataType_t` of `dtype` for a reduction (`None`: NCCL cannot sum it
/// on every version symm loads).
pub fn reduce_type(dtype: DType) -> Option<c_int> {
    Some(match dtype {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::BF16 => 9,
        DType::F8E4M3 | DType::F8E5M2 => return None,
    })
}

/// `ncclUint8`: moving bytes.
const BYTES_TYPE: c_int = 1;
/// `ncclSum`.
const SUM: c_int = 0;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type CommInitRank = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
type CommDestroy = unsafe extern "C" fn(RawComm) -> NcclResult;
type CommAbort = unsafe extern "C" fn(RawComm) -> NcclResult;
type CommGetAsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
/// send, recv, per-rank count, datatype, comm, stream.
type AllGather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, *mut c_void) -> NcclResult;
/// send, recv, count, datatype, op, comm, stream.
type Reduce = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;
type GroupCall = unsafe extern "C" fn() -> NcclResult;

/// The entry points symm uses.
#[allow(non_snake_case)]
struct Api {
    ncclGetVersion: GetVersion,
    ncclGetErrorString: GetErrorString,
    ncclGetUniqueId: GetUniqueId,
    ncclCommInitRank: CommInitRank,
    ncclCommDestroy: CommDestroy,
    // The watchdog's (`super::nccl_watch`): a call that outlives the
    // group's timeout, or an error NCCL met on its own threads, aborts.
    ncclCommAbort: CommAbort,
    ncclCommGetAsyncError: CommGetAsyncError,
    // The collectives of the transport across hosts.
    ncclAllGather: AllGather,
    ncclReduceScatter: Reduce,
    ncclAllReduce: Reduce,
    #[allow(dead_code)]
    ncclGroupStart: GroupCall,
    #[allow(dead_code)]
    ncclGroupEnd: GroupCall,
}

/// A loaded NCCL library.
pub struct Nccl {
    api: Api,
    /// Where it was loaded from (as named to the loader).
    path: String,
    /// `ncclGetVersion`'s code (e.g. 22703 for 2.27.3).
    version: i32,
}

/// The message every failure to load starts with: what needs NCCL and
/// where symm looks for it.
const NEEDED: &str = "a group spanning hosts needs NCCL: libnccl.so.2 from the system or the nvidia-nccl-cu* wheel \
                      torch installs, or SYMM_NCCL_LIBRARY pointing at it";

/// NCCL, loaded once per process on first success (a failure is tried
/// again next time, so a corrected environment is seen).
pub fn load() -> Result<&'static Nccl> {
    static LOADED: once_cell::sync::OnceCell<Nccl> = once_cell::sync::OnceCell::new();
    LOADED.get_or_try_init(|| match config::nccl_library() {
        Some(path) => Nccl::open(&path).map_err(|e| e.context(format!("{} (SYMM_NCCL_LIBRARY)", config::NCCL_LIBRARY))),
        None => Nccl::open("libnccl.so.2"),
    })
}

impl Nccl {
    /// Loads NCCL from `path` (a path, or a name the dynamic loader
    /// searches for) and checks every entry point symm uses.
    pub fn open(path: &str) -> Result<Nccl> {
        let unsupported = |what: String| err!(Unsupported, "{NEEDED}; {what}");
        let name = CString::new(path).map_err(|_| unsupported(format!("{path:?} holds a NUL byte")))?;
        // SAFETY: a valid C string; RTLD_NOW resolves everything up front.
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(unsupported(format!("loading {path}: {}", dlerror())));
        }
        let api = match Api::resolve(lib) {
            Ok(api) => api,
            Err(missing) => {
                // SAFETY: `lib` came from dlopen and nothing of it is in use.
                unsafe { libc::dlclose(lib) };
                return Err(unsupported(format!("{path} is not NCCL: it has no {missing}")));
            }
        };
        let mut version: c_int = 0;
        // SAFETY: a valid out pointer.
        let rc = unsafe { (api.ncclGetVersion)(&mut version) };
        let nccl = Nccl { api, path: path.to_string(), version };
        nccl.check(rc, "ncclGetVersion")?;
        log::info!("NCCL {} loaded from {path}", nccl.version_string());
        Ok(nccl)
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// `major.minor.patch`.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }

    /// `Err(Cuda)` naming `what` and NCCL's text for `rc` unless it is 0.
    fn check(&self, rc: NcclResult, what: &str) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let text = unsafe { (self.api.ncclGetErrorString)(rc) };
        let text = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null and NUL-terminated (static in NCCL).
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(err!(Cuda, "{what} failed: NCCL error {rc} ({text})"))
    }

    /// A new unique id (drawn by one member, for [`Communicator::join`]).
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId { internal: [0; UniqueId::BYTES] };
        // SAFETY: a valid out pointer to a 128-byte id.
        self.check(unsafe { (self.api.ncclGetUniqueId)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id)
    }
}

impl Api {
    /// Every entry point, or the name of the first one missing.
    fn resolve(lib: *mut c_void) -> std::result::Result<Api, &'static str> {
        macro_rules! sym {
            ($name:ident: $ty:ty) => {{
                let name = concat!(stringify!($name), "\0");
                // SAFETY: `lib` is a live handle and `name` NUL-terminated.
                let p = unsafe { libc::dlsym(lib, name.as_ptr().cast()) };
                if p.is_null() {
                    return Err(stringify!($name));
                }
                // SAFETY: NCCL's exported function of this name has this
                // signature (nccl.h); a pointer to function and to data are
                // the same size on every platform symm builds for.
                unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
            }};
        }
        Ok(Api {
            ncclGetVersion: sym!(ncclGetVersion: GetVersion),
            ncclGetErrorString: sym!(ncclGetErrorString: GetErrorString),
            ncclGetUniqueId: sym!(ncclGetUniqueId: GetUniqueId),
            ncclCommInitRank: sym!(ncclCommInitRank: CommInitRank),
            ncclCommDestroy: sym!(ncclCommDestroy: CommDestroy),
            ncclCommAbort: sym!(ncclCommAbort: CommAbort),
            ncclCommGetAsyncError: sym!(ncclCommGetAsyncError: CommGetAsyncError),
            ncclAllGather: sym!(ncclAllGather: AllGather),
            ncclReduceScatter: sym!(ncclReduceScatter: Reduce),
            ncclAllReduce: sym!(ncclAllReduce: Reduce),
            ncclGroupStart: sym!(ncclGroupStart: GroupCall),
            ncclGroupEnd: sym!(ncclGroupEnd: GroupCall),
        })
    }
}

/// `major.minor.patch` of an `ncclGetVersion` code: `major * 10000 +
/// minor * 100 + patch` since NCCL 2.9, `major * 1000 + minor * 100 +
/// patch` before.
fn version_string(v: i32) -> String {
    let (major, minor, patch) =
        if v >= 10000 { (v / 10000, v / 100 % 100, v % 100) } else { (v / 1000, v / 100 % 10, v % 100) };
    format!("{major}.{minor}.{patch}")
}

/// The dynamic loader's last error text.
fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until
    // the next dl call on this thread.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: see above.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// An NCCL communicator over a group's ranks, destroyed when dropped,
/// unless aborted first ([`Communicator::abort`]: NCCL frees it then).
pub struct Communicator {
    nccl: &'static Nccl,
    /// Null once aborted. Enqueues hold the read side for the length of
    /// NCCL's host call, so an abort (the write side, from the watchdog)
    /// never frees the communicator under one.
    comm: RwLock<RawComm>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time (symm serializes a group's collectives); `ncclCommAbort` is meant to
// be called from another thread while work is pending.
unsafe impl Send for Communicator {}
// SAFETY: see above.
unsafe impl Sync for Communicator {}

/// `ncclInProgress`: a nonblocking call not finished yet (not an error).
const IN_PROGRESS: NcclResult = 7;

impl Communicator {
    /// Collective over the `size` ranks that got `id`: this rank joins as
    /// member `index` on CUDA device `device`.
    pub fn join(nccl: &'static Nccl, index: usize, size: usize, device: i32, id: UniqueId) -> Result<Communicator> {
        let (rank, world) = (index, size);
        // NCCL takes the device from the thread's current context.
        super::driver::context(device)?
            .bind_to_thread()
            .map_err(|e| super::driver::cuda_err(e, "making the context current"))?;
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: a valid out pointer; the id is 128 bytes by value.
        let rc = unsafe { (nccl.api.ncclCommInitRank)(&mut comm, world as c_int, id, rank as c_int) };
        nccl.check(rc, "ncclCommInitRank").map_err(|e: Error| e.context(format!("rank {rank} of {world}")))?;
        Ok(Communicator { nccl, comm: RwLock::new(comm) })
    }

    /// Runs `f` on the live communicator (`Aborted` once aborted).
    fn with(&self, what: &str, f: impl FnOnce(RawComm) -> NcclResult) -> Result<()> {
        let comm = crate::sync::read(&self.comm);
        if comm.is_null() {
            return Err(err!(Aborted, "{what}: the NCCL communicator was aborted"));
        }
        self.nccl.check(f(*comm), what)
    }

    /// Aborts the communicator: NCCL's kernels of it still waiting end (what
    /// they were writing is left partly written) and NCCL frees it. Later
    /// calls fail with `Aborted`. Blocks while a call is being enqueued.
    pub fn abort(&self) {
        let mut comm = crate::sync::write(&self.comm);
        if comm.is_null() {
            return;
        }
        // SAFETY: a live communicator, aborted once (nulled under the lock).
        let rc = unsafe { (self.nccl.api.ncclCommAbort)(*comm) };
        *comm = std::ptr::null_mut();
        if let Err(e) = self.nccl.check(rc, "ncclCommAbort") {
            log::warn!("{e}");
        }
    }

    /// An error NCCL met asynchronously (a lost connection, a peer's
    /// abort), if any; `None` while healthy or once aborted.
    pub fn async_error(&self) -> Option<Error> {
        let comm = crate::sync::read(&self.comm);
        if comm.is_null() {
            return None;
        }
        let mut found: NcclResult = 0;
        // SAFETY: a live communicator and a valid out pointer.
        let rc = unsafe { (self.nccl.api.ncclCommGetAsyncError)(*comm, &mut found) };
        if let Err(e) = self.nccl.check(rc, "ncclCommGetAsyncError") {
            return Some(e);
        }
        match found {
            0 | IN_PROGRESS => None,
            code => self.nccl.check(code, "an NCCL operation (reported asynchronously)").err(),
        }
    }

    /// Runs `f`, whose collectives NCCL then launches together
    /// (`ncclGroupStart` / `ncclGroupEnd`), the group ended even where `f` fails.
    pub fn grouped(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        // SAFETY: no arguments; NCCL keeps the group per thread.
        self.nccl.check(unsafe { (self.nccl.api.ncclGroupStart)() }, "ncclGroupStart")?;
        let inside = f();
        // SAFETY: as above, closing the group opened here.
        let end = self.nccl.check(unsafe { (self.nccl.api.ncclGroupEnd)() }, "ncclGroupEnd");
        inside.and(end)
    }

    /// Enqueues on `stream`: `recv` (`size` x `bytes`) receives every
    /// member's `bytes` bytes at `send`, in member order. Device pointers.
    pub fn all_gather(&self, send: u64, recv: u64, bytes: usize, stream: usize) -> Result<()> {
        // SAFETY: the caller passes device buffers of these sizes and a
        // stream of this communicator's device.
        self.with("ncclAllGather", |comm| unsafe {
            (self.nccl.api.ncclAllGather)(
                send as *const c_void,
                recv as *mut c_void,
                bytes,
                BYTES_TYPE,
                comm,
                stream as *mut c_void,
            )
        })
    }

    /// Enqueues on `stream`: `recv` receives the sum over members of
    /// `count` elements of type `dtype` (see [`reduce_type`]) at `send`.
    pub fn all_reduce(&self, send: u64, recv: u64, count: usize, dtype: c_int, stream: usize) -> Result<()> {
        self.sum(self.nccl.api.ncclAllReduce, "ncclAllReduce", send, recv, count, dtype, stream)
    }

    /// Enqueues on `stream`: `recv` (`count` elements) receives the sum
    /// over members of their block of `send` (`size` x `count`) for this member.
    pub fn reduce_scatter(&self, send: u64, recv: u64, count: usize, dtype: c_int, stream: usize) -> Result<()> {
        self.sum(self.nccl.api.ncclReduceScatter, "ncclReduceScatter", send, recv, count, dtype, stream)
    }

    /// One of NCCL's summing collectives (they share a signature).
    #[allow(clippy::too_many_arguments)]
    fn sum(
        &self,
        f: Reduce,
        name: &str,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
        stream: usize,
    ) -> Result<()> {
        // SAFETY: as in `all_gather`.
        self.with(name, |comm| unsafe {
            f(send as *const c_void, recv as *mut c_void, count, dtype, SUM, comm, stream as *mut c_void)
        })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let comm = *crate::sync::read(&self.comm);
        if comm.is_null() {
            return;
        }
        // SAFETY: `comm` came from ncclCommInitRank, was not aborted, and is
        // destroyed once.
        let rc = unsafe { (self.nccl.api.ncclCommDestroy)(comm) };
        if let Err(e) = self.nccl.check(rc, "ncclCommDestroy") {
            log::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn expect_unsupported(r: Result<Nccl>, detail: &str) {
        let e = r.err().expect("not NCCL");
        assert_eq!(e.kind, ErrorKind::Unsupported);
        assert!(e.msg.starts_with(NEEDED), "{}", e.msg);
        assert!(e.msg.contains(detail), "{}", e.msg);
    }

    #[test]
    fn missing_library_is_unsupported() {
        expect_unsupported(Nccl::open("/nonexistent/libnccl.so.2"), "loading /nonexistent/libnccl.so.2");
    }

    /// A file that is no library, and a library that is not NCCL.
    #[test]
    fn other_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("symm-nccl-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = dir.join("libnccl.so.2");
        std::fs::write(&text, "not a library").unwrap();
        let text = text.to_str().unwrap().to_string();
        expect_unsupported(Nccl::open(&text), &format!("loading {text}"));
        std::fs::remove_dir_all(&dir).unwrap();
        expect_unsupported(Nccl::open("libc.so.6"), "libc.so.6 is not NCCL: it has no ncclGetVersion");
        expect_unsupported(Nccl::open("a\0b"), "NUL");
    }

    #[test]
    fn versions() {
        assert_eq!(version_string(22703), "2.27.3");
        assert_eq!(version_string(21804), "2.18.4");
        assert_eq!(version_string(2804), "2.8.4");
    }
}
