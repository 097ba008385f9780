//! Passing fds between processes of one host, for both backends: a rank
//! publishes the fd naming its allocation, peers fetch it over a Unix socket
//! (SCM_RIGHTS) and map it.
//!
//! Each process runs one [`FdServer`] on an abstract-namespace socket with a
//! random name, which ranks publish through the bootstrap. A fetch must come
//! from a process of the same user (checked with SO_PEERCRED on both ends:
//! abstract sockets have no file permissions) and present the secret the fd
//! was published with (the group's secret), compared in constant time.
//!
//! Every fd created here is close-on-exec, and every socket operation has a
//! timeout, so a stuck or dead peer produces an error instead of a hang.
//!
//! Wire format: the client sends 48 bytes, `SYMMFD01`, token (`u64` LE),
//! secret (32 bytes); the server answers one status byte, carrying the fd as
//! SCM_RIGHTS ancillary data when the status is `Status::Ok`.

use crate::bootstrap::unique_id::{ct_eq, SECRET_BYTES};
use crate::error::{ensure, err, Error, Result};
use crate::sync::lock;
use crate::wire::{Reader, Writer};
use std::collections::HashMap;
use std::io::{self, Read};
use std::mem::{size_of, zeroed};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"SYMMFD01";
const REQUEST_BYTES: usize = MAGIC.len() + 8 + SECRET_BYTES;
/// Longest abstract name: `sun_path` minus the leading NUL.
const MAX_NAME: usize = 107;
/// How long the server gives one client to send its request and take the
/// answer; a stuck client only ever ties up its own serving thread.
const SERVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The server's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Status {
    Ok = 0,
    UnknownToken = 1,
    WrongSecret = 2,
    BadRequest = 3,
    ForeignUser = 4,
    ServerError = 5,
}

impl Status {
    fn from_byte(b: u8) -> Option<Status> {
        [
            Status::Ok,
            Status::UnknownToken,
            Status::WrongSecret,
            Status::BadRequest,
            Status::ForeignUser,
            Status::ServerError,
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }
}

struct Entry {
    secret: [u8; SECRET_BYTES],
    fd: OwnedFd,
}

type Table = Arc<Mutex<HashMap<u64, Entry>>>;

/// This process's fd server.
pub struct FdServer {
    name: Vec<u8>,
    table: Table,
    /// The process that started it; a forked child needs its own.
    pid: u32,
}

/// Keeps an fd published; dropping it unpublishes and closes the server's dup.
#[must_use = "dropping a Publication unpublishes the fd at once"]
pub struct Publication {
    table: Table,
    token: u64,
}

impl Drop for Publication {
    fn drop(&mut self) {
        lock(&self.table).remove(&self.token);
    }
}

impl std::fmt::Debug for Publication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Publication(token {})", self.token)
    }
}

static SERVER: Mutex<Option<&'static FdServer>> = Mutex::new(None);

/// This process's fd server, started on first use (and again in a forked
/// child, which inherits the socket but not the serving thread).
pub fn fd_server() -> Result<&'static FdServer> {
    let mut slot = lock(&SERVER);
    if let Some(s) = *slot {
        if s.pid == std::process::id() {
            return Ok(s);
        }
    }
    // Leaked on purpose: the server lives until the process exits.
    let s: &'static FdServer = Box::leak(Box::new(FdServer::start()?));
    *slot = Some(s);
    Ok(s)
}

impl FdServer {
    fn start() -> Result<FdServer> {
        let name = random_name()?;
        let addr = SocketAddr::from_abstract_name(&name).map_err(|e| Error::os("ipc: bad socket name", e))?;
        // std creates the socket and accepted connections with CLOEXEC.
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::os("ipc: cannot listen on an abstract Unix socket", e))?;
        let table: Table = Arc::new(Mutex::new(HashMap::new()));
        let t = table.clone();
        thread::Builder::new()
            .name("symm-fd-server".into())
            .spawn(move || accept_loop(listener, t))
            .map_err(|e| Error::os("ipc: cannot start the fd server thread", e))?;
        Ok(FdServer { name, table, pid: std::process::id() })
    }

    /// The abstract socket name (without the leading NUL), to publish to peers.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// Serves a dup of `fd` under `token` to peers presenting `secret`,
    /// until the returned [`Publication`] is dropped.
    pub fn publish(&self, token: u64, secret: [u8; SECRET_BYTES], fd: BorrowedFd) -> Result<Publication> {
        // F_DUPFD_CLOEXEC: the dup never leaks into exec'd children.
        let fd = fd.try_clone_to_owned().map_err(|e| Error::os("ipc: cannot duplicate the fd to publish", e))?;
        let mut table = lock(&self.table);
        ensure!(!table.contains_key(&token), InvalidArgument, "ipc: token {token} is already published");
        table.insert(token, Entry { secret, fd });
        Ok(Publication { table: self.table.clone(), token })
    }
}

fn random_name() -> Result<Vec<u8>> {
    let mut r = [0u8; 8];
    getrandom::fill(&mut r).map_err(|e| err!(System, "getrandom failed: {e}"))?;
    let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("symm-{}-{hex}", std::process::id()).into_bytes())
}

fn accept_loop(listener: UnixListener, table: Table) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else {
            // Out of fds or similar: back off instead of spinning.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        // Turn away other users before spending a thread on them.
        if peer_uid(&conn).ok() != Some(euid()) {
            let _ = send_status(&conn, Status::ForeignUser, None);
            continue;
        }
        let t = table.clone();
        // If no thread can be had the connection is dropped; the client
        // sees it closed.
        let _ = thread::Builder::new().name("symm-fd-conn".into()).spawn(move || serve(conn, &t));
    }
}

/// Answers one request.
fn serve(mut conn: UnixStream, table: &Mutex<HashMap<u64, Entry>>) {
    let _ = conn.set_read_timeout(Some(SERVE_TIMEOUT));
    let _ = conn.set_write_timeout(Some(SERVE_TIMEOUT));
    let mut req = [0u8; REQUEST_BYTES];
    if conn.read_exact(&mut req).is_err() {
        return;
    }
    let (status, fd) = lookup(table, &req);
    let _ = send_status(&conn, status, fd.as_ref().map(|f| f.as_fd()));
    // `fd` (a dup made for this answer) closes here; the peer holds its own.
}

/// Checks a request against the table; on success returns a dup of the fd,
/// made under the lock so an unpublish cannot close it mid-send.
fn lookup(table: &Mutex<HashMap<u64, Entry>>, req: &[u8; REQUEST_BYTES]) -> (Status, Option<OwnedFd>) {
    let mut r = Reader::new(req, "fd request");
    let (Ok(magic), Ok(token), Ok(secret)) = (r.raw(MAGIC.len()), r.u64(), r.raw(SECRET_BYTES)) else {
        return (Status::BadRequest, None);
    };
    if magic != MAGIC {
        return (Status::BadRequest, None);
    }
    let table = lock(table);
    let Some(entry) = table.get(&token) else { return (Status::UnknownToken, None) };
    if !ct_eq(&entry.secret, secret) {
        return (Status::WrongSecret, None);
    }
    match entry.fd.try_clone() {
        Ok(fd) => (Status::Ok, Some(fd)),
        Err(_) => (Status::ServerError, None),
    }
}

/// Fetches the fd published under `token` by the server named `server_name`,
/// presenting `secret`. Each socket step waits at most what is left of
/// `timeout`.
pub fn fetch_fd(server_name: &[u8], token: u64, secret: &[u8; SECRET_BYTES], timeout: Duration) -> Result<OwnedFd> {
    let shown = String::from_utf8_lossy(server_name).into_owned();
    ensure!(
        !server_name.is_empty() && server_name.len() <= MAX_NAME,
        InvalidArgument,
        "ipc: fd server name must be 1..={MAX_NAME} bytes, got {}",
        server_name.len()
    );
    let deadline = Instant::now() + timeout.min(Duration::from_secs(365 * 24 * 3600));
    let conn = connect(server_name, &shown, deadline)?;
    let uid = peer_uid(&conn).map_err(|e| Error::os("ipc: SO_PEERCRED", e))?;
    ensure!(
        uid == euid(),
        Bootstrap,
        "ipc: fd server '{shown}' runs as uid {uid}, not as this process's uid {}",
        euid()
    );
    let req = Writer::new().raw(MAGIC).u64(token).raw(secret).finish();
    set_timeouts(&conn, deadline, &shown)?;
    send_all(&conn, &req).map_err(|e| io_error(e, &shown, timeout))?;
    set_timeouts(&conn, deadline, &shown)?;
    let (status, fds) = recv_status(&conn).map_err(|e| io_error(e, &shown, timeout))?;
    answer(status, fds, &shown, token)
}

/// Turns the server's status into the fd or a clear error.
fn answer(status: u8, mut fds: Vec<OwnedFd>, server: &str, token: u64) -> Result<OwnedFd> {
    match Status::from_byte(status) {
        Some(Status::Ok) if fds.len() == 1 => Ok(fds.pop().unwrap()),
        Some(Status::Ok) => {
            Err(err!(Bootstrap, "ipc: fd server '{server}' sent {} fds for token {token}, expected 1", fds.len()))
        }
        Some(Status::UnknownToken) => Err(err!(
            Bootstrap,
            "ipc: fd server '{server}' has nothing published under token {token} \
             (already unpublished, or the wrong token)"
        )),
        Some(Status::WrongSecret) => {
            Err(err!(Bootstrap, "ipc: fd server '{server}' refused token {token}: wrong secret (another group's?)"))
        }
        Some(Status::ForeignUser) => {
            Err(err!(Bootstrap, "ipc: fd server '{server}' refused this process: it runs as another user"))
        }
        Some(Status::BadRequest) => Err(err!(Bootstrap, "ipc: fd server '{server}' did not understand the request")),
        Some(Status::ServerError) => {
            Err(err!(Bootstrap, "ipc: fd server '{server}' could not duplicate the fd for token {token} (out of fds?)"))
        }
        None => Err(err!(Bootstrap, "ipc: fd server '{server}' sent unknown status {status}")),
    }
}

fn io_error(e: io::Error, server: &str, timeout: Duration) -> Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            err!(Timeout, "ipc: fd server '{server}' did not answer within {} ms", timeout.as_millis())
        }
        _ => err!(Bootstrap, "ipc: talking to fd server '{server}' failed: {e}"),
    }
}

/// Sets both socket timeouts to what is left until `deadline`.
fn set_timeouts(conn: &UnixStream, deadline: Instant, server: &str) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    ensure!(!left.is_zero(), Timeout, "ipc: fd server '{server}' did not answer in time");
    conn.set_read_timeout(Some(left))
        .and_then(|_| conn.set_write_timeout(Some(left)))
        .map_err(|e| Error::os("ipc: setting socket timeouts", e))
}

/// Connects to an abstract socket. The send timeout is set first because it
/// also bounds connect() when the server's backlog is full.
fn connect(name: &[u8], shown: &str, deadline: Instant) -> Result<UnixStream> {
    // SAFETY: plain socket(2); the result is checked before use.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(Error::last_os("ipc: socket"));
    }
    // SAFETY: `raw` is a fresh fd that nothing else owns.
    let conn = UnixStream::from(unsafe { OwnedFd::from_raw_fd(raw) });
    set_timeouts(&conn, deadline, shown)?;
    let (addr, len) = abstract_addr(name);
    loop {
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
        let rc = unsafe { libc::connect(conn.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) };
        if rc == 0 {
            return Ok(conn);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EISCONN) => return Ok(conn),
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => {
                return Err(err!(Bootstrap, "ipc: no fd server is listening on '{shown}' (has its process exited?)"))
            }
            Some(libc::EAGAIN) | Some(libc::ETIMEDOUT) => {
                return Err(err!(Timeout, "ipc: fd server '{shown}' did not accept in time"))
            }
            _ => return Err(err!(Bootstrap, "ipc: cannot connect to fd server '{shown}': {e}")),
        }
    }
}

fn abstract_addr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // sun_path[0] stays 0: that is what makes the name abstract.
    for (dst, &src) in addr.sun_path[1..].iter_mut().zip(name) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    (addr, len as libc::socklen_t)
}

pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid of the process at the other end of a Unix socket.
pub(crate) fn peer_uid(conn: &UnixStream) -> io::Result<u32> {
    // SAFETY: ucred is plain old data; getsockopt fills at most `len` bytes.
    unsafe {
        let mut cred: libc::ucred = zeroed();
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        let rc = libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cred.uid)
    }
}

/// Writes all of `buf`; MSG_NOSIGNAL because a C host program may not
/// ignore SIGPIPE, and a vanished peer must not kill it.
fn send_all(conn: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is valid for its length.
        let n = unsafe { libc::send(conn.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Control-message buffer, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 128]);

/// Sends the one-byte status, with `fd` attached as SCM_RIGHTS if given.
fn send_status(conn: &UnixStream, status: Status, fd: Option<BorrowedFd>) -> io::Result<()> {
    let mut byte = [status as u8];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut cbuf = CmsgBuf([0; 128]);
    // SAFETY: msghdr is plain old data; the pointers set below outlive the
    // sendmsg call, and CMSG_* stay within `cbuf` (CMSG_SPACE(4) <= 128).
    unsafe {
        let mut msg: libc::msghdr = zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            let raw: RawFd = fd.as_raw_fd();
            msg.msg_control = cbuf.0.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(size_of::<RawFd>() as u32) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), raw);
        }
        loop {
            let n = libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
            if n == 1 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(if n < 0 { e } else { io::ErrorKind::WriteZero.into() });
        }
    }
}

/// Receives the status byte and any fds sent with it. Every fd received is
/// owned at once (and closed if unwanted); MSG_CMSG_CLOEXEC makes them
/// close-on-exec atomically.
fn recv_status(conn: &UnixStream) -> io::Result<(u8, Vec<OwnedFd>)> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut cbuf = CmsgBuf([0; 128]);
    // SAFETY: as in send_status; the kernel writes at most msg_controllen
    // bytes of control data, and we walk it with the CMSG_* macros.
    unsafe {
        let mut msg: libc::msghdr = zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = cbuf.0.len() as _;
        let n = loop {
            let n = libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n >= 0 {
                break n;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let fds = take_fds(&msg);
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection without answering",
            ));
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "control data was truncated"));
        }
        Ok((byte[0], fds))
    }
}

/// Collects the fds of every SCM_RIGHTS message in `msg`.
///
/// # Safety
/// `msg` must have been filled by a successful recvmsg.
unsafe fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    let mut c = libc::CMSG_FIRSTHDR(msg);
    while !c.is_null() {
        if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
            let data = libc::CMSG_DATA(c).cast::<RawFd>();
            let bytes = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
            for i in 0..bytes / size_of::<RawFd>() {
                let raw = std::ptr::read_unaligned(data.add(i));
                fds.push(OwnedFd::from_raw_fd(raw));
            }
        }
        c = libc::CMSG_NXTHDR(msg, c);
    }
    fds
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicU64, Ordering};

    const T: Duration = Duration::from_secs(5);

    /// A token no other test uses (the library's own are random).
    fn new_token() -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    fn memfd(data: &[u8]) -> OwnedFd {
        // SAFETY: a NUL-terminated name; the result is checked.
        let raw = unsafe { libc::memfd_create(c"symm-ipc-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: `raw` is a fresh fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `data` is valid for its length.
        let n = unsafe { libc::pwrite(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), 0) };
        assert_eq!(n as usize, data.len());
        fd
    }

    /// Maps `len` bytes of `fd` and copies them out.
    fn mapped(fd: &OwnedFd, len: usize) -> Vec<u8> {
        // SAFETY: a fresh shared read-only mapping of `len` bytes, unmapped
        // after copying.
        unsafe {
            let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0);
            assert_ne!(p, libc::MAP_FAILED);
            let v = std::slice::from_raw_parts(p.cast::<u8>(), len).to_vec();
            libc::munmap(p, len);
            v
        }
    }

    fn cloexec(fd: &OwnedFd) -> bool {
        // SAFETY: F_GETFD on a valid fd.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        flags & libc::FD_CLOEXEC != 0
    }

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    #[test]
    fn fetches_a_memfd() {
        let srv = fd_server().unwrap();
        assert!(srv.name().starts_with(format!("symm-{}-", std::process::id()).as_bytes()));
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let fd = memfd(&data);
        let token = new_token();
        let pubn = srv.publish(token, [4; 32], fd.as_fd()).unwrap();
        let got = fetch_fd(srv.name(), token, &[4; 32], T).unwrap();
        assert!(cloexec(&got));
        assert_ne!(got.as_raw_fd(), fd.as_raw_fd());
        assert_eq!(mapped(&got, data.len()), data);
        // The same memory, not a copy.
        // SAFETY: writing one byte of a valid buffer.
        unsafe { libc::pwrite(fd.as_raw_fd(), [0xeeu8].as_ptr().cast(), 1, 5) };
        assert_eq!(mapped(&got, 8)[5], 0xee);
        drop(pubn);
    }

    #[test]
    fn wrong_secret_and_unknown_token_are_refused() {
        let srv = fd_server().unwrap();
        let fd = memfd(b"x");
        let token = new_token();
        let pubn = srv.publish(token, [1; 32], fd.as_fd()).unwrap();
        let e = fetch_fd(srv.name(), token, &[2; 32], T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains("wrong secret"), "{e}");
        let e = fetch_fd(srv.name(), token + 1_000_000, &[1; 32], T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains("nothing published"), "{e}");
        // Publishing a token twice is refused; unpublishing makes it unknown.
        assert_eq!(srv.publish(token, [1; 32], fd.as_fd()).unwrap_err().kind, ErrorKind::InvalidArgument);
        drop(pubn);
        let e = fetch_fd(srv.name(), token, &[1; 32], T).unwrap_err();
        assert!(e.msg.contains("nothing published"), "{e}");
    }

    #[test]
    fn absent_or_silent_server() {
        let e = fetch_fd(b"symm-no-such-server-0000", 1, &[0; 32], T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains("no fd server"), "{e}");
        assert_eq!(fetch_fd(b"", 1, &[0; 32], T).unwrap_err().kind, ErrorKind::InvalidArgument);

        // A listener that never answers: the fetch times out.
        let name = random_name().unwrap();
        let _l = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let t = Instant::now();
        let e = fetch_fd(&name, 1, &[0; 32], Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn no_fd_leaks() {
        // Other tests open and close fds in this process meanwhile (a CI
        // run once saw 300 more at the end): count them in a child process
        // that runs this test alone.
        use crate::config::tests_env;
        if !tests_env::fd_leak_child() {
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new(exe)
                .args(["--exact", "ipc::tests::no_fd_leaks", "--test-threads", "1"])
                .env(tests_env::FD_LEAK_CHILD, "1")
                .output()
                .unwrap();
            let log = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success() && log.contains("1 passed"), "the child process: {log}");
            return;
        }
        let srv = fd_server().unwrap();
        let fd = memfd(&[9; 64]);
        let round = |secret: [u8; 32]| {
            let token = new_token();
            let p = srv.publish(token, [3; 32], fd.as_fd()).unwrap();
            let r = fetch_fd(srv.name(), token, &secret, T);
            drop(p);
            r
        };
        for _ in 0..50 {
            round([3; 32]).unwrap();
        }
        let before = open_fds();
        for i in 0..10_000 {
            let r = round(if i % 10 == 0 { [0; 32] } else { [3; 32] });
            assert_eq!(r.is_ok(), i % 10 != 0);
        }
        // Serving threads close their end just after answering; give the
        // last ones a moment.
        let deadline = Instant::now() + Duration::from_secs(2);
        while open_fds() > before + 4 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        let after = open_fds();
        assert!(after <= before + 4, "fds grew from {before} to {after}");
    }
}
