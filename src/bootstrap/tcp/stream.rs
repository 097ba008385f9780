//! The store's two transports behind one type: TCP (unique ids, and env
//! groups spanning hosts) and abstract Unix sockets (env groups on one host,
//! whose peers are authenticated by their uid instead of a secret).

use crate::ipc::{euid, peer_uid};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{self, UnixListener, UnixStream};
use std::time::Duration;

/// Where a store listens and clients dial.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) enum Target {
    Tcp(SocketAddr),
    /// An abstract Unix socket name (without the leading NUL).
    Unix(Vec<u8>),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Tcp(a) => write!(f, "{a}"),
            Target::Unix(n) => write!(f, "@{}", String::from_utf8_lossy(n)),
        }
    }
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Target {
    /// Connects, waiting at most `timeout`. A Unix store must run as this
    /// process's user: anyone may bind an abstract name, so one held by
    /// another user is a squatter, refused before a byte is sent.
    pub(crate) fn dial(&self, timeout: Duration) -> io::Result<Stream> {
        match self {
            Target::Tcp(a) => TcpStream::connect_timeout(a, timeout).map(Stream::Tcp),
            Target::Unix(name) => {
                let s = UnixStream::connect_addr(&unix_addr(name)?)?;
                let uid = peer_uid(&s)?;
                if uid != euid() {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("the socket is held by uid {uid}, not by this user (uid {})", euid()),
                    ));
                }
                Ok(Stream::Unix(s))
            }
        }
    }

    /// Binds a listener.
    pub(crate) fn bind(&self) -> io::Result<Listener> {
        match self {
            Target::Tcp(a) => TcpListener::bind(a).map(Listener::Tcp),
            Target::Unix(name) => UnixListener::bind_addr(&unix_addr(name)?).map(Listener::Unix),
        }
    }
}

fn unix_addr(name: &[u8]) -> io::Result<net::SocketAddr> {
    net::SocketAddr::from_abstract_name(name)
}

/// A listening socket of either kind.
pub(crate) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// Accepts one connection. Unix peers of another user are turned away
    /// here, before they cost a thread.
    pub(crate) fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::Tcp(s)),
            Listener::Unix(l) => {
                let (s, _) = l.accept()?;
                if peer_uid(&s)? != euid() {
                    return Err(io::Error::new(io::ErrorKind::PermissionDenied, "a peer of another user"));
                }
                Ok(Stream::Unix(s))
            }
        }
    }

    /// The bound TCP address (None for Unix listeners).
    pub(crate) fn tcp_addr(&self) -> io::Result<Option<SocketAddr>> {
        match self {
            Listener::Tcp(l) => l.local_addr().map(Some),
            Listener::Unix(_) => Ok(None),
        }
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l) => l.as_raw_fd(),
        }
    }
}

/// A connected socket of either kind.
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        match self {
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
        }
    }

    /// Ends both directions, waking any thread blocked on the socket.
    pub(crate) fn shutdown(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        }
    }

    /// Small frames go out at once (TCP only; Unix sockets do not batch).
    pub(crate) fn set_nodelay(&self) {
        if let Stream::Tcp(s) = self {
            let _ = s.set_nodelay(true);
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
