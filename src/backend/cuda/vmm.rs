//! Symmetric memory on CUDA: VMM allocations exportable as POSIX fds, and
//! peers' allocations imported from such fds and mapped into this rank's
//! address space (UVA), readable and writable from this rank's device.

use super::driver::check;
use crate::backend::{Allocation, Mapping};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn location(device: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device }
}

fn properties(device: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        // SAFETY: an all-zero allocFlags is the documented default.
        allocFlags: unsafe { std::mem::zeroed() },
    }
}

/// The allocation granularity VMM recommends on `device` (2 MiB on Hopper).
pub fn granularity(device: i32) -> Result<usize> {
    let mut g = 0usize;
    let prop = properties(device);
    // SAFETY: valid out-pointer and property struct.
    check(
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        "cuMemGetAllocationGranularity",
    )?;
    Ok(g.max(1))
}

/// A reserved virtual range with `handle` mapped into it, accessible from
/// `device`. Unmapped and freed on drop.
struct MappedRange {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl MappedRange {
    fn map(handle: sys::CUmemGenericAllocationHandle, len: usize, device: i32) -> Result<Self> {
        let mut ptr = 0;
        // SAFETY: out-pointer valid; len is granularity-aligned by the caller.
        check(unsafe { sys::cuMemAddressReserve(&mut ptr, len, 0, 0, 0) }, "cuMemAddressReserve")?;
        let range = MappedRange { ptr, len };
        // SAFETY: the range was just reserved with this length.
        if let Err(e) = check(unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) }, "cuMemMap") {
            // SAFETY: reserved above, nothing mapped.
            unsafe { sys::cuMemAddressFree(ptr, len) };
            std::mem::forget(range);
            return Err(e);
        }
        let access = sys::CUmemAccessDesc {
            location: location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one descriptor.
        check(unsafe { sys::cuMemSetAccess(ptr, len, &access, 1) }, "cuMemSetAccess")?;
        Ok(range)
    }
}

impl Drop for MappedRange {
    fn drop(&mut self) {
        // SAFETY: mapped and reserved by `map`; errors here cannot be reported.
        unsafe {
            sys::cuMemUnmap(self.ptr, self.len);
            sys::cuMemAddressFree(self.ptr, self.len);
        }
    }
}

/// Device memory this rank allocated; the handle is kept for export.
pub struct VmmAllocation {
    /// `Some` until drop, which unmaps before releasing the handle.
    range: Option<MappedRange>,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl VmmAllocation {
    /// Allocates `len` bytes (a multiple of the granularity) on `device`.
    /// The memory is not zeroed here; the backend does that on its stream.
    pub fn new(device: i32, len: usize) -> Result<Self> {
        let prop = properties(device);
        let mut handle = 0;
        // SAFETY: valid out-pointer and properties.
        check(unsafe { sys::cuMemCreate(&mut handle, len, &prop, 0) }, "cuMemCreate")
            .map_err(|e| e.context(format!("allocating {len} bytes on device {device}")))?;
        match MappedRange::map(handle, len, device) {
            Ok(range) => Ok(VmmAllocation { ptr: range.ptr, len: range.len, range: Some(range), handle }),
            Err(e) => {
                // SAFETY: created above, not mapped.
                unsafe { sys::cuMemRelease(handle) };
                Err(e)
            }
        }
    }
}

impl Drop for VmmAllocation {
    fn drop(&mut self) {
        drop(self.range.take());
        // SAFETY: created by cuMemCreate; physical memory lives on while
        // peers still map it.
        unsafe { sys::cuMemRelease(self.handle) };
    }
}

impl Mapping for VmmAllocation {
    fn addr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Allocation for VmmAllocation {
    fn export_fd(&self) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX fds the shareable handle is an int out-parameter.
        check(
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut std::ffi::c_int).cast(),
                    self.handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            "cuMemExportToShareableHandle",
        )?;
        // SAFETY: the driver returned a new fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// A peer's allocation mapped here. The import handle is released once
/// mapped: the mapping alone keeps the memory alive.
pub struct VmmMapping {
    range: MappedRange,
}

impl VmmMapping {
    pub fn import(fd: OwnedFd, len: usize, device: i32) -> Result<Self> {
        let mut handle = 0;
        // SAFETY: for POSIX fds the OS handle is the fd value itself.
        check(
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            },
            "cuMemImportFromShareableHandle",
        )?;
        drop(fd);
        let mapped = MappedRange::map(handle, len, device);
        // SAFETY: imported above; the mapping (if any) holds its own reference.
        unsafe { sys::cuMemRelease(handle) };
        Ok(VmmMapping { range: mapped.map_err(|e: Error| e.context("mapping a peer's buffer"))? })
    }
}

impl Mapping for VmmMapping {
    fn addr(&self) -> u64 {
        self.range.ptr
    }
    fn len(&self) -> usize {
        self.range.len
    }
}
