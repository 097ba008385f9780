//! Launching the sm90 matmul: the parameter block mirrored from the
//! kernel, its entry points (one per input types, tile width and fp8
//! accumulation), the probe that tells whether the loaded module holds the
//! sm_90a code, and the launch itself.

use super::tiling::TileN;
use super::tmap::{encode, encode_box, encode_tiled, MapType, RsMaps, TensorMap};
use super::{Operand, Sm90Matmul, BK_BYTES, BM, C_BOX_ROWS, MAX_CHUNKS, SYMBOLS, THREADS};
use crate::backend::cuda::driver::{self, check};
use crate::backend::cuda::gemm::{Fp8, GemmDtype};
use crate::backend::Stream;
use crate::error::Result;
use cudarc::driver::{sys, CudaFunction, CudaModule};
use std::ffi::c_void;
use std::sync::Arc;

/// Mirror of `struct symm_gemm_params` (kernels/sm90_params.cuh, which
/// asserts the same size and offsets).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Params {
    m: i32,
    n: i32,
    k: i32,
    out_dtype: i32,
    c: u64,
    ldc: i64,
    chunks: i32,
    chunk_rows: i32,
    order: [i32; MAX_CHUNKS],
    local_chunk: i32,
    ready: u64,
    rank: i32,
    world: i32,
    inbox: [u64; MAX_CHUNKS],
    rs_state: [u64; MAX_CHUNKS],
    alpha: f32,
    c_tma: i32,
    timeout_ns: u64,
    err: u64,
    a_scale: u64,
    b_scale: u64,
    bias: u64,
    a_scale_slot: i64,
    scale_mode: i32,
    rs_push: i32,
    slices: i32,
    slice_kblocks: i32,
    rs_narrow_n: i32,
    rs_narrow_w: i32,
    rs_narrow_less: i32,
    rs_c_store: i32,
    cut_n: i32,
    cut_w: i32,
    rs_tag: u32,
}

const _: () = assert!(std::mem::size_of::<Params>() == 488);
const _: () = assert!(std::mem::offset_of!(Params, order) == 40);
const _: () = assert!(std::mem::offset_of!(Params, ready) == 112);
const _: () = assert!(std::mem::offset_of!(Params, inbox) == 128);
const _: () = assert!(std::mem::offset_of!(Params, alpha) == 384);
const _: () = assert!(std::mem::offset_of!(Params, a_scale) == 408);
const _: () = assert!(std::mem::offset_of!(Params, scale_mode) == 440);
const _: () = assert!(std::mem::offset_of!(Params, rs_narrow_n) == 456);
const _: () = assert!(std::mem::offset_of!(Params, cut_w) == 476);
const _: () = assert!(std::mem::offset_of!(Params, rs_tag) == 480);

/// `SYMM_RS_C_*`: how a fused reduce-scatter's own rows reach C.
pub(super) const RS_C_REGISTERS: i32 = 0;
pub(super) const RS_C_RING: i32 = 2;
pub(super) const RS_C_ADD: i32 = 3;

/// `SYMM_GEMM_SCALES_*`.
const SCALES_NONE: i32 = 0;
const SCALES_TENSOR: i32 = 1;
const SCALES_ROW: i32 = 2;

/// The input types the kernels come in, as named in their entry points
/// (`symm_gemm_sm90[_rs]_<name>_n<cols>`); the fp8 ones (the last three)
/// also as `..._n128_exact`, which promote partial sums into f32 registers.
const INPUTS: [&str; 5] = ["bf16", "f16", "e4m3_e4m3", "e4m3_e5m2", "e5m2_e4m3"];

/// The loaded kernels of one device: the matmul ones (kernels/gemm_sm90.cu)
/// and the reduce-scatter ones (kernels/gemm_sm90_rs.cu, `symm_gemm_sm90_rs_`).
pub struct Sm90Kernels {
    matmul: ModeKernels,
    reduce_scatter: ModeKernels,
}

/// One mode's entry points: `[INPUTS][N128, N256]`, and the exact fp8 ones.
struct ModeKernels {
    functions: Vec<[CudaFunction; 2]>,
    exact: Vec<CudaFunction>,
}

impl Sm90Kernels {
    /// The kernels when the modules (`matmul`: gemm_sm90.cu's,
    /// `reduce_scatter`: gemm_sm90_rs.cu's) can run them on this device,
    /// else `None` (another architecture, a driver without the tensor-map
    /// encoder, or modules the driver loaded from non-sm_90a code).
    pub fn load(matmul: &Arc<CudaModule>, reduce_scatter: &Arc<CudaModule>, ordinal: i32) -> Result<Option<Self>> {
        use sys::CUdevice_attribute::*;
        let major = driver::attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = driver::attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        if (major, minor) != (9, 0) || !driver_has_symbols() {
            return Ok(None);
        }
        if !probe(&function(matmul, "symm_gemm_sm90_probe")?)? {
            return Ok(None);
        }
        Ok(Some(Sm90Kernels {
            matmul: ModeKernels::load(matmul, "symm_gemm_sm90")?,
            reduce_scatter: ModeKernels::load(reduce_scatter, "symm_gemm_sm90_rs")?,
        }))
    }

    /// The kernel for `mm`'s mode, input types, accumulation and tile (checked).
    fn function(&self, mm: &Sm90Matmul) -> &CudaFunction {
        let mode = if mm.scatter.is_some() { &self.reduce_scatter } else { &self.matmul };
        mode.function(mm)
    }
}

fn function(module: &Arc<CudaModule>, name: &str) -> Result<CudaFunction> {
    let f = module.load_function(name).map_err(|e| driver::cuda_err(e, &format!("loading kernel {name}")))?;
    driver::load_now(&f, name)?;
    Ok(f)
}

impl ModeKernels {
    /// The entry points named `<prefix>_<input>_n<cols>[_exact]` in `module`,
    /// each allowed its tile's shared memory.
    fn load(module: &Arc<CudaModule>, prefix: &str) -> Result<Self> {
        let f = |name: String| function(module, &name);
        let functions = INPUTS
            .iter()
            .map(|i| Ok([f(format!("{prefix}_{i}_n128"))?, f(format!("{prefix}_{i}_n256"))?]))
            .collect::<Result<Vec<_>>>()?;
        let exact = INPUTS[2..].iter().map(|i| f(format!("{prefix}_{i}_n128_exact"))).collect::<Result<Vec<_>>>()?;
        let sized = functions
            .iter()
            .flat_map(|[n128, n256]| [(n128, TileN::N128), (n256, TileN::N256)])
            .chain(exact.iter().map(|f| (f, TileN::N128)));
        for (function, tile) in sized {
            let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            // SAFETY: a loaded function; symbols checked.
            check(
                unsafe { sys::cuFuncSetAttribute(function.cu_function(), attr, tile.smem_bytes() as i32) },
                "cuFuncSetAttribute",
            )?;
        }
        Ok(ModeKernels { functions, exact })
    }

    fn function(&self, mm: &Sm90Matmul) -> &CudaFunction {
        let row = match mm.fp8 {
            None if mm.dtype == GemmDtype::F16 => 1,
            None => 0,
            Some(f) => match (f.a_type, f.b_type) {
                (Fp8::E4M3, Fp8::E4M3) => 2,
                (Fp8::E4M3, Fp8::E5M2) => 3,
                _ => 4,
            },
        };
        match mm.fp8 {
            Some(f) if !f.fast_accum => &self.exact[row - 2],
            _ => &self.functions[row][mm.tile as usize],
        }
    }
}

fn driver_has_symbols() -> bool {
    // SAFETY: the driver was checked present by the backend before any module loads.
    let lib = unsafe { sys::culib() };
    // SAFETY (in the closure): looking a symbol up has no side effects.
    driver::missing_symbols(SYMBOLS, |n| unsafe { lib.get::<unsafe extern "C" fn()>(n) }.is_ok()).is_empty()
}

/// Runs `symm_gemm_sm90_probe` on a private stream: true when the driver
/// loaded the sm_90a code. Writes into mapped host memory and synchronizes
/// only that stream, so ranks sharing the device are never waited for.
fn probe(f: &CudaFunction) -> Result<bool> {
    let mut host = std::ptr::null_mut();
    // SAFETY: out-pointer valid; flags are driver constants.
    check(unsafe { sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }, "cuMemHostAlloc")?;
    let result = (|| {
        // SAFETY: 4 bytes just allocated.
        unsafe { (host as *mut i32).write_volatile(-1) };
        let mut dev = 0u64;
        // SAFETY: mapped host memory.
        check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }, "cuMemHostGetDevicePointer")?;
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: out-pointer valid.
        check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "cuStreamCreate")?;
        let mut params = [(&mut dev as *mut u64).cast::<c_void>()];
        // SAFETY: the probe takes one pointer; `dev` outlives the launch.
        let launched = check(
            unsafe {
                sys::cuLaunchKernel(
                    f.cu_function(),
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "launching symm_gemm_sm90_probe",
        )
        .and_then(|()| check(unsafe { sys::cuStreamSynchronize(stream) }, "cuStreamSynchronize"));
        // SAFETY: created above.
        unsafe { sys::cuStreamDestroy_v2(stream) };
        launched?;
        // SAFETY: the stream finished; the kernel wrote 0 or 1.
        Ok(unsafe { (host as *const i32).read_volatile() } == 1)
    })();
    // SAFETY: allocated above, no longer used by the device.
    unsafe { sys::cuMemFreeHost(host) };
    result
}

impl Sm90Matmul {
    /// Enqueues the matmul on `stream`. `sm_count` is the device's.
    pub fn launch(&self, kernels: &Sm90Kernels, sm_count: u32, stream: Stream) -> Result<()> {
        self.check()?;
        let input = if self.fp8.is_some() { MapType::Byte } else { MapType::Elem(self.dtype) };
        let tm_a = match &self.gather {
            // Slice-major: [slices][m][slice_k].
            Some(g) if self.slices() > 1 => {
                let (el, a) = (input.size() as u64, &self.a);
                let dims = [g.slice_k as u64, a.rows as u64, self.slices() as u64];
                let strides = [g.slice_k as u64 * el, (a.rows * g.slice_k) as u64 * el];
                encode_tiled(input, a.ptr, &dims, &strides, &[(BK_BYTES / input.size()) as u32, BM as u32, 1])?
            }
            _ => encode(input, &self.a, self.k, BM)?,
        };
        let tm_a_local = match &self.gather {
            Some(g) => encode(input, &g.local, self.k, BM)?,
            None => tm_a,
        };
        let tm_b = encode(input, &self.b, self.k, self.tile.cols())?;
        let mut p = self.params();
        let (grid, cut) = self.layout(sm_count);
        if let Some(cut) = cut {
            (p.cut_n, p.cut_w) = (cut.tiles as i32, cut.width as i32);
        }
        let out = MapType::Elem(self.out_dtype);
        let c_box = BK_BYTES / self.out_dtype.size();
        // C through TMA stores where it can be (placeholder maps otherwise):
        // a plain C whole, or this rank's rows of a reduce-scatter.
        let mut rs = RsMaps { inbox: tm_a, push: [tm_a; MAX_CHUNKS] };
        let tm_c = if self.c_through_tma() {
            p.c_tma = 1;
            encode_box(out, &Operand { rows: self.m, ..self.c }, self.n, c_box, C_BOX_ROWS)?
        } else if let (Some(s), true) = (&self.scatter, self.rs_pushes()) {
            // Every rank pushes alike; only its own rows' store depends on
            // its C.
            p.rs_c_store = self.rs_c_store();
            let slot_bytes = (self.chunk_rows * self.n * self.out_dtype.size()) as u64;
            for (d, &inbox) in s.inbox.iter().enumerate().filter(|&(d, _)| d != s.rank) {
                // Into rank d's inbox slot for this rank, or added into its C.
                let ptr = match (&s.out, p.rs_c_store) {
                    (Some(outs), RS_C_ADD) => outs[d],
                    _ => inbox + s.rank as u64 * slot_bytes,
                };
                let dst = Operand { ptr, rows: self.chunk_rows, ld: self.n };
                rs.push[d] = encode_box(out, &dst, self.n, c_box, C_BOX_ROWS)?;
            }
            let dims = [self.n as u64, self.chunk_rows as u64, self.chunks() as u64];
            let strides = [(self.n * self.out_dtype.size()) as u64, slot_bytes];
            rs.inbox = encode_tiled(out, s.inbox[s.rank], &dims, &strides, &[c_box as u32, BM as u32, 1])?;
            if p.rs_c_store != RS_C_REGISTERS {
                encode_box(out, &self.c, self.n, c_box, C_BOX_ROWS)?
            } else {
                tm_a
            }
        } else {
            tm_a
        };
        let (mut a, mut al, mut b, mut c) = (tm_a, tm_a_local, tm_b, tm_c);
        let mut args = [
            (&mut a as *mut TensorMap).cast::<c_void>(),
            (&mut al as *mut TensorMap).cast(),
            (&mut b as *mut TensorMap).cast(),
            (&mut c as *mut TensorMap).cast(),
            (&mut rs as *mut RsMaps).cast(),
            (&mut p as *mut Params).cast(),
        ];
        let f = kernels.function(self);
        // SAFETY: the arguments match the kernel's six parameters and live
        // until the call returns (the driver copies them).
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f.cu_function(),
                    grid,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    self.tile.smem_bytes() as u32,
                    stream.0 as sys::CUstream,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "launching symm's sm90 matmul",
        )
    }

    pub(super) fn params(&self) -> Params {
        let narrow = self.narrow();
        let mut order = [0i32; MAX_CHUNKS];
        for (o, &c) in order.iter_mut().zip(&self.order) {
            *o = c as i32;
        }
        let (mut inbox, mut rs_state) = ([0u64; MAX_CHUNKS], [0u64; MAX_CHUNKS]);
        let (mut rank, mut world) = (0, self.chunks() as i32);
        if let Some(s) = &self.scatter {
            inbox[..s.inbox.len()].copy_from_slice(&s.inbox);
            rs_state[..s.state.len()].copy_from_slice(&s.state);
            rank = s.rank as i32;
        }
        if let Some(g) = &self.gather {
            rank = g.local_chunk as i32;
        }
        world = world.max(1);
        let (scale_mode, a_scale, b_scale, bias) = match self.fp8 {
            None => (SCALES_NONE, 0, 0, 0),
            Some(f) => (if f.row_wise { SCALES_ROW } else { SCALES_TENSOR }, f.a_scale, f.b_scale, f.bias),
        };
        Params {
            m: self.m as i32,
            n: self.n as i32,
            k: self.k as i32,
            out_dtype: self.out_dtype as i32,
            c: self.c.ptr,
            ldc: self.c.ld as i64,
            chunks: self.chunks() as i32,
            chunk_rows: self.chunk_rows as i32,
            order,
            local_chunk: self.gather.as_ref().map_or(-1, |g| g.local_chunk as i32),
            ready: self.gather.as_ref().map_or(0, |g| g.ready),
            rank,
            world,
            inbox,
            rs_state,
            alpha: self.alpha,
            c_tma: 0,
            timeout_ns: self.timeout_ns,
            err: self.err,
            a_scale,
            b_scale,
            bias,
            a_scale_slot: self.gather.as_ref().map_or(self.chunk_rows, |g| g.scale_slot) as i64,
            scale_mode,
            rs_push: i32::from(self.rs_pushes()),
            slices: self.slices() as i32,
            slice_kblocks: self.slice_kblocks() as i32,
            rs_narrow_n: narrow.map_or(0, |w| w.tiles as i32),
            rs_narrow_w: narrow.map_or(0, |w| w.width as i32),
            rs_narrow_less: narrow.map_or(0, |w| w.narrower as i32),
            rs_c_store: RS_C_REGISTERS,
            cut_n: 0,
            cut_w: 0,
            rs_tag: self.scatter.as_ref().map_or(0, |s| s.tag.get()),
        }
    }
}
