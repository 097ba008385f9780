//! Shared memory for the host backend: anonymous memfds, mapped MAP_SHARED
//! so that every rank that maps the fd sees the same bytes.

use crate::backend::{Allocation, Mapping};
use crate::error::{ensure, Error, Result};
use std::ffi::CStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// A shared, writable mapping of `len` bytes of `fd`, unmapped on drop.
struct SharedMap {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the map is plain memory shared between processes; all access to
// its contents goes through raw addresses whose users synchronize.
unsafe impl Send for SharedMap {}
unsafe impl Sync for SharedMap {}

impl SharedMap {
    fn new(fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        // SAFETY: mapping a valid fd with a fresh address; the kernel checks the rest.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::last_os(format!("mmap of {len} bytes of shared memory")));
        }
        Ok(SharedMap { addr, len })
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: addr/len came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// Memory this rank allocated: the memfd (kept for export) and its map.
pub struct HostAllocation {
    fd: OwnedFd,
    map: SharedMap,
}

impl HostAllocation {
    pub fn new(len: usize) -> Result<Self> {
        ensure!(len > 0, InvalidArgument, "cannot allocate 0 bytes");
        // A memfd is sized lazily: a buffer larger than the host's memory
        // would succeed here and kill the process once touched.
        let ram = physical_memory();
        ensure!(len <= ram, OutOfMemory, "cannot allocate {len} bytes: more than this host's memory ({ram} bytes)");
        let name: &CStr = c"symm";
        // SAFETY: name is a valid C string; flags are constants.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::last_os("memfd_create"));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // ftruncate zero-fills, which is what a fresh symmetric buffer promises.
        // SAFETY: fd is valid.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            let e = std::io::Error::last_os_error();
            let kind = if e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::ENOMEM) {
                crate::error::ErrorKind::OutOfMemory
            } else {
                crate::error::ErrorKind::System
            };
            return Err(Error::new(kind, format!("sizing shared memory to {len} bytes: {e}")));
        }
        let map = SharedMap::new(fd.as_fd(), len)?;
        Ok(HostAllocation { fd, map })
    }
}

/// This host's physical memory in bytes (`usize::MAX` where it cannot say).
fn physical_memory() -> usize {
    // SAFETY: sysconf reads constants.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    match (usize::try_from(pages), usize::try_from(size)) {
        (Ok(p), Ok(s)) if p > 0 && s > 0 => p.saturating_mul(s),
        _ => usize::MAX,
    }
}

impl Mapping for HostAllocation {
    fn addr(&self) -> u64 {
        self.map.addr as u64
    }
    fn len(&self) -> usize {
        self.map.len
    }
}

impl Allocation for HostAllocation {
    fn export_fd(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(|e| Error::os("duplicating a shared-memory fd", e))
    }
}

/// A peer's allocation mapped into this process. The fd is closed once
/// mapped: the map alone keeps the memory alive.
pub struct HostMapping {
    map: SharedMap,
}

impl HostMapping {
    pub fn import(fd: OwnedFd, len: usize) -> Result<Self> {
        // A peer's memfd smaller than announced would fault on access: check.
        // SAFETY: fstat into a zeroed struct on a valid fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::last_os("fstat of a peer's shared memory"));
        }
        ensure!(
            st.st_size as u64 >= len as u64,
            Mismatch,
            "a peer's shared memory holds {} bytes, {len} expected",
            st.st_size
        );
        Ok(HostMapping { map: SharedMap::new(fd.as_fd(), len)? })
    }
}

impl Mapping for HostMapping {
    fn addr(&self) -> u64 {
        self.map.addr as u64
    }
    fn len(&self) -> usize {
        self.map.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_and_import_share_bytes() {
        let a = HostAllocation::new(page_size()).unwrap();
        // SAFETY: the allocation is page_size bytes, zeroed.
        let local = unsafe { std::slice::from_raw_parts_mut(a.addr() as *mut u8, a.len()) };
        assert!(local.iter().all(|&b| b == 0));
        let peer = HostMapping::import(a.export_fd().unwrap(), a.len()).unwrap();
        local[17] = 0x5a;
        // SAFETY: the mapping is the same memfd.
        assert_eq!(unsafe { *(peer.addr() as *const u8).add(17) }, 0x5a);
    }

    #[test]
    fn import_rejects_short_memory() {
        let a = HostAllocation::new(page_size()).unwrap();
        let e = HostMapping::import(a.export_fd().unwrap(), 2 * page_size()).err().unwrap();
        assert_eq!(e.kind, crate::error::ErrorKind::Mismatch);
    }

    #[test]
    fn zero_bytes_is_invalid() {
        assert_eq!(HostAllocation::new(0).err().unwrap().kind, crate::error::ErrorKind::InvalidArgument);
    }

    /// More than the host's memory (past `off_t` too) is out of memory,
    /// not a buffer that kills the process when touched.
    #[test]
    fn more_than_the_host_has_is_out_of_memory() {
        for len in [physical_memory().saturating_add(1), usize::MAX / 2 + 1, usize::MAX] {
            let e = HostAllocation::new(len).err().unwrap();
            assert_eq!(e.kind, crate::error::ErrorKind::OutOfMemory, "{e}");
        }
    }
}
