//! Loading the CUDA driver safely and talking to it.
//!
//! cudarc resolves every symbol lazily and panics when the library or a
//! symbol is missing, so before the first call we check the library and
//! every symbol the backend uses; a machine without a driver then gets
//! `NoDevice` with a message, never a panic. Contexts are the devices'
//! primary contexts (what the CUDA runtime, PyTorch and JAX use), one per
//! device, retained for the life of the process.

use crate::error::{err, Error, ErrorKind, Result};
use cudarc::driver::{sys, CudaContext};
use once_cell::sync::OnceCell;
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex};

/// Every driver entry point the backend calls, checked once up front.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuCtxEnablePeerAccess",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyHtoD_v2",
    "cuMemsetD8Async",
    "cuMemsetD2D8Async",
    "cuMemcpyAsync",
    "cuMemcpy2DAsync_v2",
    "cuStreamCreate",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventElapsedTime_v2",
    "cuEventDestroy_v2",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuStreamWriteValue32_v2",
    "cuStreamWaitValue32_v2",
    "cuStreamIsCapturing",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphGetNodes",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphDestroy",
    "cuGraphExecDestroy",
    "cuStreamGetCtx",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuLaunchHostFunc",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Entry points used only where the driver has them, each checked at its
/// use (`load_now`).
const OPTIONAL_SYMBOLS: &[&str] = &["cuFuncLoad"];

/// `Ok` once the driver library and every symbol we use are present.
pub fn ensure_driver() -> Result<()> {
    static CHECKED: OnceCell<std::result::Result<(), String>> = OnceCell::new();
    CHECKED.get_or_init(check_driver).clone().map_err(|m| Error::new(ErrorKind::NoDevice, m))
}

fn check_driver() -> std::result::Result<(), String> {
    // SAFETY: only dlopens candidate names; never panics.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver: libcuda.so could not be loaded (is the NVIDIA driver installed?)".into());
    }
    // SAFETY: the library is present, so culib() does not panic.
    let lib = unsafe { sys::culib() };
    // SAFETY (in the closure): looking a symbol up has no side effects.
    let missing = missing_symbols(SYMBOLS, |n| unsafe { lib.get::<unsafe extern "C" fn()>(n) }.is_ok());
    if !missing.is_empty() {
        return Err(format!("the CUDA driver is too old: it lacks {}", missing.join(", ")));
    }
    // SAFETY: symbols checked above.
    check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| e.msg)
}

/// Loads `f`'s code now rather than at its first launch. Under CUDA's
/// default lazy module loading, a kernel's first launch may synchronize
/// the context; launched behind a kernel that spins until it runs (the
/// fused matmul waiting for the side stream's barrier and copies), that
/// would never return (CUDA Programming Guide, "Lazy Loading", concurrent
/// execution). Drivers before CUDA 12.4 lack `cuFuncLoad`; there the kernel
/// stays lazy (`CUDA_MODULE_LOADING=EAGER` avoids it).
pub fn load_now(f: &cudarc::driver::CudaFunction, name: &str) -> Result<()> {
    static HAS_FUNC_LOAD: OnceCell<bool> = OnceCell::new();
    let has = *HAS_FUNC_LOAD.get_or_init(|| {
        // SAFETY: the driver is present (a function exists); a lookup has no side effects.
        missing_symbols(OPTIONAL_SYMBOLS, |n| unsafe { sys::culib().get::<unsafe extern "C" fn()>(n) }.is_ok())
            .is_empty()
    });
    if !has {
        return Ok(());
    }
    // SAFETY: a function of a module loaded in its (current) context.
    check(unsafe { sys::cuFuncLoad(f.cu_function()) }, &format!("loading kernel {name}"))
}

/// The names in `symbols` for which `present` (given the NUL-terminated
/// name) says no: cudarc would panic on first use of any of them.
pub fn missing_symbols<'a>(symbols: &[&'a str], present: impl Fn(&[u8]) -> bool) -> Vec<&'a str> {
    symbols.iter().copied().filter(|s| !present(format!("{s}\0").as_bytes())).collect()
}

/// Converts a driver result into ours, naming the call.
pub fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let kind = match r {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_INVALID_DEVICE => ErrorKind::NoDevice,
        _ => ErrorKind::Cuda,
    };
    Err(Error::new(kind, format!("{what} failed: {}", describe(r))))
}

/// "CUDA_ERROR_X (text)" for a driver result.
pub fn describe(r: sys::CUresult) -> String {
    let mut name = std::ptr::null();
    let mut text = std::ptr::null();
    // SAFETY: the driver returns static strings (or leaves the pointers null).
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{r:?}")
        } else {
            // SAFETY: non-null static C string from the driver.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{} ({})", s(name), s(text))
}

/// Number of CUDA devices, 0 when there is no driver.
pub fn device_count() -> usize {
    if ensure_driver().is_err() {
        return 0;
    }
    let mut n = 0;
    // SAFETY: driver checked; out-pointer valid.
    match unsafe { sys::cuDeviceGetCount(&mut n) } {
        sys::CUresult::CUDA_SUCCESS => n.max(0) as usize,
        _ => 0,
    }
}

/// The primary context of `ordinal`, retained once per process and made
/// current on the calling thread.
pub fn context(ordinal: i32) -> Result<Arc<CudaContext>> {
    static CONTEXTS: Mutex<BTreeMap<i32, Arc<CudaContext>>> = Mutex::new(BTreeMap::new());
    ensure_driver()?;
    let count = device_count();
    if ordinal < 0 || ordinal as usize >= count {
        return Err(err!(NoDevice, "CUDA device {ordinal} does not exist ({count} visible)"));
    }
    let mut map = crate::sync::lock(&CONTEXTS);
    let ctx = match map.get(&ordinal) {
        Some(c) => c.clone(),
        None => {
            let c = CudaContext::new(ordinal as usize).map_err(|e| cuda_err(e, "retaining the primary context"))?;
            // We order our own work with events and flags; cudarc's tracking
            // would synchronize in places that are illegal during capture.
            // SAFETY: no CudaSlice of ours relies on the tracking.
            unsafe { c.disable_event_tracking() };
            map.insert(ordinal, c.clone());
            c
        }
    };
    drop(map);
    ctx.bind_to_thread().map_err(|e| cuda_err(e, "making the context current"))?;
    Ok(ctx)
}

/// Converts cudarc's driver error.
pub fn cuda_err(e: cudarc::driver::DriverError, what: &str) -> Error {
    check(e.0, what).unwrap_err()
}

/// Device attribute query.
pub fn attribute(ordinal: i32, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: driver checked by the caller's context(); out-pointer valid.
    check(unsafe { sys::cuDeviceGetAttribute(&mut v, attr, ordinal) }, "cuDeviceGetAttribute")?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every driver entry point the backend's code (tests aside) calls is
    /// checked before first use, here or in the fused matmul's list, so a
    /// driver that lacks one gives an error, never cudarc's panic.
    #[test]
    fn every_driver_call_is_checked_up_front() {
        let sources = [
            include_str!("async_error.rs"),
            include_str!("compute.rs"),
            include_str!("device_bytes.rs"),
            include_str!("driver.rs"),
            include_str!("event.rs"),
            include_str!("gemm/mod.rs"),
            include_str!("gemm/lt_matmul.rs"),
            include_str!("gemm/params.rs"),
            include_str!("gemm/tune.rs"),
            include_str!("graphs.rs"),
            include_str!("kernels.rs"),
            include_str!("mod.rs"),
            include_str!("module.rs"),
            include_str!("nccl_watch.rs"),
            include_str!("pack.rs"),
            include_str!("reduce.rs"),
            include_str!("signals.rs"),
            include_str!("sm90/launch.rs"),
            include_str!("sm90/matmul.rs"),
            include_str!("sm90/tiling.rs"),
            include_str!("sm90/tmap.rs"),
            include_str!("streams.rs"),
            include_str!("vmm.rs"),
        ];
        let checked: Vec<&str> =
            SYMBOLS.iter().chain(OPTIONAL_SYMBOLS).chain(super::super::sm90::SYMBOLS).copied().collect();
        let mut unchecked = Vec::new();
        for source in sources {
            let code = source.split("#[cfg(test)]\nmod tests").next().unwrap();
            for call in code.split("sys::cu").skip(1) {
                let name: String = call.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                let name = format!("cu{name}");
                // culib() is cudarc's handle on the library, not a driver call.
                let is_call = call[name.len() - 2..].starts_with('(') && name != "culib";
                if is_call && !checked.contains(&name.as_str()) {
                    unchecked.push(name);
                }
            }
        }
        assert!(unchecked.is_empty(), "driver calls not in SYMBOLS: {unchecked:?}");
    }

    #[test]
    fn missing_driver_or_device_is_an_error_not_a_panic() {
        // On machines without a GPU this reports NoDevice; with one, a
        // device far out of range is still NoDevice.
        let e = context(1 << 20).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NoDevice, "{}", e.msg);
    }
}
