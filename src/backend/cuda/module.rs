//! The kernels of `kernels/`, loaded once per device: from the fatbins nvcc
//! built into the library (one module per `kernels/*.cu`), or compiled at
//! run time by NVRTC for the device's own architecture, as one module, when
//! the library was built without nvcc.

use super::driver::{cuda_err, describe};
use super::kernels;
use crate::backend::Stream;
use crate::error::{err, Result};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CString};
use std::sync::{Arc, Mutex};

/// The entry points of one device's modules.
pub struct Kernels {
    _modules: Modules,
    pub put_signal: CudaFunction,
    pub wait_signal: CudaFunction,
    pub barrier: CudaFunction,
    pub wait_value: CudaFunction,
    pub check_tags: CudaFunction,
    /// `symm_reduce_*`, indexed by `GemmDtype as usize` (reduce.rs).
    pub reduce: [CudaFunction; 3],
    /// `symm_reduce_int_*`, by `all_reduce::int_index` (reduce.rs).
    pub reduce_int: [CudaFunction; 4],
    /// `symm_ar_{one,two}_shot_*`, by `AllReduceAlgorithm as usize`, then
    /// `GemmDtype as usize` (all_reduce.rs).
    pub all_reduce: [[CudaFunction; 3]; 2],
    /// `symm_ar_{one,two}_shot_{i8,u8,i32,i64}`, by `AllReduceAlgorithm as
    /// usize`, then `all_reduce::int_index` (all_reduce.rs).
    pub all_reduce_int: [[CudaFunction; 4]; 2],
    /// `symm_ag_{one,two}_shot`, by `AllReduceAlgorithm as usize`
    /// (all_reduce.rs).
    pub all_gather: [CudaFunction; 2],
    /// `symm_rs_{one,two}_shot_*`, by `AllReduceAlgorithm as usize`, then
    /// `GemmDtype as usize` (all_reduce.rs).
    pub reduce_scatter: [[CudaFunction; 3]; 2],
    /// `symm_add_rmsnorm_*`, by `GemmDtype as usize` (all_reduce.rs).
    pub add_rmsnorm: [CudaFunction; 3],
    /// `symm_pack_rows_v{1,2,4,8,16}`, indexed by log2 of the access width (pack.rs).
    pub pack_rows: [CudaFunction; 5],
    /// `symm_pack_strided_e{1,2,4,8}`, indexed by log2 of the element size (pack.rs).
    pub pack_strided: [CudaFunction; 4],
    /// `symm_pack_tiled_e{1,2,4,8}`, indexed by log2 of the element size (pack.rs).
    pub pack_tiled: [CudaFunction; 4],
    /// `symm_quantize_{e4m3,e5m2}` (quantize.rs).
    pub quantize: [CudaFunction; 2],
    /// symm's own Hopper matmul (kernels/gemm_sm90.cu, gemm_sm90_rs.cu), when this device
    /// runs its sm_90a code.
    pub gemm_sm90: Option<super::sm90::Sm90Kernels>,
    /// The device's multiprocessor count, for sizing grids.
    pub sm_count: u32,
    /// The context the module lives in (made current before launches).
    pub ctx: Arc<CudaContext>,
}

// SAFETY: CUfunction handles are usable from any thread of the process.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

/// Kernel parameter: the address of an argument value.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

impl Kernels {
    /// Launches `f` on `stream` with this device's context current (the
    /// caller's thread may have another device's current). `what` names the
    /// kernel in errors.
    ///
    /// # Safety
    /// `params` must match `f`'s parameters (see kernels/) and stay valid
    /// until this returns.
    pub unsafe fn launch(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: (u32, u32, u32),
        stream: Stream,
        params: &mut [*mut c_void],
        what: &str,
    ) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda_err(e, "making the context current"))?;
        // SAFETY: the caller's contract.
        unsafe { result::launch_kernel(f.cu_function(), (grid, 1, 1), block, 0, stream.0 as sys::CUstream, params) }
            .map_err(|e| cuda_err(e, &format!("launching {what}")))
    }
}

/// The kernels for `ctx`'s device, loaded on first use.
pub fn kernels(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
    static LOADED: Mutex<BTreeMap<usize, Arc<Kernels>>> = Mutex::new(BTreeMap::new());
    let mut map = crate::sync::lock(&LOADED);
    if let Some(k) = map.get(&ctx.ordinal()) {
        return Ok(k.clone());
    }
    let modules = load(ctx)?;
    use kernels::names::{self, units};
    let signal = |name: &str| modules.function(units::SIGNAL, name);
    let reduce = |name: &str| modules.function(units::REDUCE, name);
    let pack = |name: &str| modules.function(units::PACK, name);
    let ar = |name: &str| modules.function(units::ALL_REDUCE, name);
    let ar3 = |n: [&str; 3]| -> Result<[CudaFunction; 3]> { Ok([ar(n[0])?, ar(n[1])?, ar(n[2])?]) };
    let ar4 = |n: [&str; 4]| -> Result<[CudaFunction; 4]> { Ok([ar(n[0])?, ar(n[1])?, ar(n[2])?, ar(n[3])?]) };
    let (matmul, reduce_scatter) = (modules.unit(units::GEMM_SM90)?, modules.unit(units::GEMM_SM90_RS)?);
    let k = Arc::new(Kernels {
        put_signal: signal(names::PUT_SIGNAL)?,
        wait_signal: signal(names::WAIT_SIGNAL)?,
        barrier: signal(names::BARRIER)?,
        wait_value: signal(names::WAIT_VALUE)?,
        check_tags: signal(names::CHECK_TAGS)?,
        reduce: {
            let n = names::REDUCE;
            [reduce(n[0])?, reduce(n[1])?, reduce(n[2])?]
        },
        reduce_int: {
            let n = names::REDUCE_INT;
            [reduce(n[0])?, reduce(n[1])?, reduce(n[2])?, reduce(n[3])?]
        },
        all_reduce: [ar3(names::ALL_REDUCE[0])?, ar3(names::ALL_REDUCE[1])?],
        all_reduce_int: [ar4(names::ALL_REDUCE_INT[0])?, ar4(names::ALL_REDUCE_INT[1])?],
        all_gather: [ar(names::ALL_GATHER[0])?, ar(names::ALL_GATHER[1])?],
        reduce_scatter: [ar3(names::REDUCE_SCATTER[0])?, ar3(names::REDUCE_SCATTER[1])?],
        add_rmsnorm: ar3(names::ADD_RMSNORM)?,
        pack_rows: {
            let n = names::PACK_ROWS;
            [pack(n[0])?, pack(n[1])?, pack(n[2])?, pack(n[3])?, pack(n[4])?]
        },
        pack_strided: {
            let n = names::PACK_STRIDED;
            [pack(n[0])?, pack(n[1])?, pack(n[2])?, pack(n[3])?]
        },
        pack_tiled: {
            let n = names::PACK_TILED;
            [pack(n[0])?, pack(n[1])?, pack(n[2])?, pack(n[3])?]
        },
        quantize: {
            let q = |name: &str| modules.function(units::QUANTIZE, name);
            [q(names::QUANTIZE[0])?, q(names::QUANTIZE[1])?]
        },
        gemm_sm90: super::sm90::Sm90Kernels::load(matmul, reduce_scatter, ctx.ordinal() as i32)?,
        sm_count: super::driver::attribute(
            ctx.ordinal() as i32,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?
        .max(1) as u32,
        ctx: ctx.clone(),
        _modules: modules,
    });
    map.insert(ctx.ordinal(), k.clone());
    Ok(k)
}

/// The loaded modules of one device: one per embedded fatbin, by its unit
/// (`kernels/<unit>`), or the one NVRTC compiled from all units. Kernels
/// are looked up in the module of the unit that defines them, so no lookup
/// fails (a failing cuModuleGetFunction is an error to compute-sanitizer).
struct Modules {
    by_unit: Vec<(&'static str, Arc<CudaModule>)>,
    nvrtc: Option<Arc<CudaModule>>,
}

impl Modules {
    /// The module holding `unit`'s kernels.
    fn unit(&self, unit: &str) -> Result<&Arc<CudaModule>> {
        if let Some(m) = &self.nvrtc {
            return Ok(m);
        }
        self.by_unit
            .iter()
            .find(|(u, _)| *u == unit)
            .map(|(_, m)| m)
            .ok_or_else(|| err!(Cuda, "symm's kernels ({}) have no module for kernels/{unit}", kernels::build_info()))
    }

    /// The entry point `name` of `unit`.
    fn function(&self, unit: &str, name: &str) -> Result<CudaFunction> {
        let f = self
            .unit(unit)?
            .load_function(name)
            .map_err(|e| cuda_err(e, &format!("loading kernel {name} of {unit}")))?;
        super::driver::load_now(&f, name)?;
        Ok(f)
    }
}

fn load(ctx: &Arc<CudaContext>) -> Result<Modules> {
    if kernels::fatbins().next().is_none() {
        log::info!("kernels: {}; compiling them with NVRTC for device {}", kernels::build_info(), ctx.ordinal());
        let cubin = nvrtc_cubin(ctx).inspect_err(|e| log::warn!("kernels: {}", e.msg))?;
        return Ok(Modules { by_unit: Vec::new(), nvrtc: Some(load_image(ctx, cubin, "NVRTC")?) });
    }
    let by_unit = kernels::fatbins()
        .map(|(unit, image)| Ok((unit, load_image(ctx, image.to_vec(), unit)?)))
        .collect::<Result<_>>()?;
    Ok(Modules { by_unit, nvrtc: None })
}

/// Loads one module from `image` (a fatbin or cubin); `what` names it in errors.
fn load_image(ctx: &Arc<CudaContext>, image: Vec<u8>, what: &str) -> Result<Arc<CudaModule>> {
    ctx.load_module(Ptx::from_binary(image)).map_err(|e| {
        let hint = match e.0 {
            sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
                ": the kernels' PTX is newer than this driver; build symm with nvcc 13.0 (see .ci/install-nvcc.sh)"
            }
            sys::CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU => ": the kernels were not built for this GPU",
            _ => "",
        };
        err!(Cuda, "loading symm's kernels ({what}; {}) failed: {}{hint}", kernels::build_info(), describe(e.0))
    })
}

/// Compiles the embedded kernel sources with NVRTC into a cubin for the
/// device's architecture.
fn nvrtc_cubin(ctx: &Arc<CudaContext>) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result as nr, sys as nv};
    // SAFETY: only dlopens candidates.
    if !unsafe { nv::is_culib_present() } {
        return Err(err!(
            Unsupported,
            "symm was built without nvcc and NVRTC (libnvrtc.so.13) is not available to compile its kernels at run time"
        ));
    }
    let (major, minor) = ctx.compute_capability().map_err(|e| cuda_err(e, "querying the compute capability"))?;
    let suffix = if major == 9 && minor == 0 { "a" } else { "" };
    let arch = format!("--gpu-architecture=sm_{major}{minor}{suffix}");
    let cstr = |s: &str| CString::new(s).expect("kernel sources contain no NUL");
    let names: Vec<CString> = kernels::sources().iter().map(|(n, _)| cstr(n)).collect();
    let texts: Vec<CString> = kernels::sources().iter().map(|(_, t)| cstr(t)).collect();
    let name_ptrs: Vec<_> = names.iter().map(|c| c.as_ptr()).collect();
    let text_ptrs: Vec<_> = texts.iter().map(|c| c.as_ptr()).collect();
    let unity = cstr(kernels::unity_source());
    let mut prog = std::ptr::null_mut();
    let fail = |what: &str, e: nv::nvrtcResult| err!(Cuda, "NVRTC {what} failed: {e:?}");
    // SAFETY: all pointers outlive the program; counts match the arrays.
    unsafe {
        let r = nv::nvrtcCreateProgram(
            &mut prog,
            unity.as_ptr(),
            c"symm_kernels.cu".as_ptr(),
            names.len() as c_int,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        );
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            return Err(fail("nvrtcCreateProgram", r));
        }
        let compiled = nr::compile_program(prog, &[arch.as_str(), "-std=c++17"]);
        let result = match compiled {
            Ok(()) => {
                let mut size = 0usize;
                let r = nv::nvrtcGetCUBINSize(prog, &mut size);
                let mut cubin = vec![0u8; size];
                let r2 = if r == nv::nvrtcResult::NVRTC_SUCCESS {
                    nv::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                } else {
                    r
                };
                if r2 == nv::nvrtcResult::NVRTC_SUCCESS {
                    Ok(cubin)
                } else {
                    Err(fail("nvrtcGetCUBIN", r2))
                }
            }
            Err(_) => {
                let log = nr::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
                Err(err!(Cuda, "NVRTC could not compile symm's kernels for {arch}:\n{}", String::from_utf8_lossy(&log)))
            }
        };
        let _ = nr::destroy_program(prog);
        result
    }
}
