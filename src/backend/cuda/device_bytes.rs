//! A small allocation of device memory owned by a host object (`cuMemAlloc`:
//! stream memory operations and NCCL both take it), freed with it.

use super::driver::check;
use crate::error::Result;
use cudarc::driver::sys;

pub struct DeviceBytes {
    pub addr: u64,
    bytes: usize,
}

impl DeviceBytes {
    /// `bytes` of device memory (not initialized) on the current context's device.
    pub fn new(bytes: usize) -> Result<DeviceBytes> {
        let mut addr = 0;
        // SAFETY: out-pointer valid; the caller made the context current.
        check(unsafe { sys::cuMemAlloc_v2(&mut addr, bytes.max(1)) }, "cuMemAlloc")?;
        Ok(DeviceBytes { addr, bytes })
    }

    /// Copies `data` to byte `offset` (synchronously: for setup).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        assert!(offset + data.len() <= self.bytes, "a write past the allocation");
        // SAFETY: within the allocation (asserted); `data` is readable.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(self.addr + offset as u64, data.as_ptr().cast(), data.len()) },
            "cuMemcpyHtoD",
        )
    }
}

impl Drop for DeviceBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once.
        unsafe { sys::cuMemFree_v2(self.addr) };
    }
}
