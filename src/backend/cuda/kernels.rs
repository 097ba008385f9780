//! The CUDA kernels of `kernels/`, as built by `build.rs`.
//!
//! * [`fatbins`]: the fatbins nvcc produced at build time, one per
//!   `kernels/*.cu` (SASS for sm_80, sm_90, sm_90a, sm_100 and PTX for
//!   compute_90), or none when the crate was built without nvcc. Load each
//!   with `cuModuleLoadData` (or `cuLibraryLoadData`) as its own module; the
//!   driver picks the SASS matching the device or JIT-compiles the PTX. An
//!   entry point is in the module of the unit that defines it.
//! * [`sources`] and [`unity_source`]: always present, for the NVRTC
//!   fallback. Compile [`unity_source`] (it `#include`s every `.cu` by bare
//!   name) with every entry of [`sources`] given to `nvrtcCreateProgram` as
//!   an in-memory header (`headers` = texts, `includeNames` = names), for
//!   the device's own architecture (`--gpu-architecture=sm_XY`,
//!   `-std=c++17`), and load the resulting CUBIN.
//!
//! Entry points are `extern "C"`, so their names are not mangled; the
//! signal kernels' C signatures and the error record are documented in
//! `kernels/signal.cu` and `kernels/common.cuh`.

mod generated {
    include!(concat!(env!("OUT_DIR"), "/symm_kernel_sources.rs"));
}

mod generated_fatbins {
    include!(concat!(env!("OUT_DIR"), "/symm_kernel_fatbins.rs"));
}

/// `include_bytes!` data is only byte-aligned; the driver expects a fatbin
/// image at least 8-byte aligned (as nvcc places it in `.nv_fatbin`).
#[repr(C, align(16))]
#[cfg_attr(not(symm_fatbin), allow(dead_code))] // built only by the generated fatbin list
struct Aligned<B: ?Sized>(B);

/// The build-time fatbins, (unit, image) for each `kernels/*.cu` in name
/// order, or none if nvcc was not available when the crate was built. Each
/// image is 16-byte aligned and lives for the whole program, so its pointer
/// can go straight to `cuModuleLoadData`.
pub fn fatbins() -> impl Iterator<Item = (&'static str, &'static [u8])> {
    generated_fatbins::KERNEL_FATBINS.iter().map(|(unit, image)| (*unit, &image.0))
}

/// (file name, text) of every `kernels/*.cu` and `kernels/*.cuh`, sorted by
/// name. Always embedded, whether or not a fatbin was built.
pub fn sources() -> &'static [(&'static str, &'static str)] {
    generated::KERNEL_SOURCES
}

/// The single translation unit to compile with NVRTC: one `#include "x.cu"`
/// line per kernel file, resolved against [`sources`] as in-memory headers.
pub fn unity_source() -> &'static str {
    generated::KERNEL_UNITY_SOURCE
}

/// How the kernels were built, for diagnostics: "fatbin by nvcc 13.0.88
/// (path)" or "sources only (NVRTC at run time)".
pub fn build_info() -> &'static str {
    env!("SYMM_KERNELS_BUILD")
}

/// Kernel entry-point names (`extern "C"`, unmangled), each with the unit
/// (`kernels/*.cu`) that defines it.
pub mod names {
    /// The units, as [`super::fatbins`] names them.
    pub mod units {
        pub const SIGNAL: &str = "signal.cu";
        pub const REDUCE: &str = "reduce.cu";
        pub const PACK: &str = "pack.cu";
        pub const GEMM_SM90: &str = "gemm_sm90.cu";
        pub const GEMM_SM90_RS: &str = "gemm_sm90_rs.cu";
        pub const ALL_REDUCE: &str = "allreduce.cu";
        pub const QUANTIZE: &str = "quantize.cu";
    }

    pub const PUT_SIGNAL: &str = "symm_put_signal";
    pub const WAIT_SIGNAL: &str = "symm_wait_signal";
    pub const BARRIER: &str = "symm_barrier";
    pub const WAIT_VALUE: &str = "symm_wait_value";
    pub const CHECK_TAGS: &str = "symm_check_tags";
    /// kernels/reduce.cu, indexed by `GemmDtype as usize` (F32, BF16, F16).
    pub const REDUCE: [&str; 3] = ["symm_reduce_f32", "symm_reduce_bf16", "symm_reduce_f16"];
    /// kernels/reduce.cu, integers: int8, uint8, int32, int64
    /// (`cuda::all_reduce::int_index`).
    pub const REDUCE_INT: [&str; 4] =
        ["symm_reduce_int_i8", "symm_reduce_int_u8", "symm_reduce_int_i32", "symm_reduce_int_i64"];
    /// kernels/allreduce.cu, by `AllReduceAlgorithm as usize` (one-shot,
    /// two-shot), then `GemmDtype as usize` (F32, BF16, F16).
    pub const ALL_REDUCE: [[&str; 3]; 2] = [
        ["symm_ar_one_shot_f32", "symm_ar_one_shot_bf16", "symm_ar_one_shot_f16"],
        ["symm_ar_two_shot_f32", "symm_ar_two_shot_bf16", "symm_ar_two_shot_f16"],
    ];
    /// kernels/allreduce.cu, integers: by `AllReduceAlgorithm as usize`,
    /// then int8, uint8, int32, int64 (`cuda::all_reduce::int_index`).
    pub const ALL_REDUCE_INT: [[&str; 4]; 2] = [
        ["symm_ar_one_shot_i8", "symm_ar_one_shot_u8", "symm_ar_one_shot_i32", "symm_ar_one_shot_i64"],
        ["symm_ar_two_shot_i8", "symm_ar_two_shot_u8", "symm_ar_two_shot_i32", "symm_ar_two_shot_i64"],
    ];
    /// kernels/allreduce.cu, the all-gather through the all-reduce's
    /// buffer (any element type): by `AllReduceAlgorithm as usize` (LL
    /// lines, or pieces).
    pub const ALL_GATHER: [&str; 2] = ["symm_ag_one_shot", "symm_ag_two_shot"];
    /// kernels/allreduce.cu, the reduce-scatter through the all-reduce's
    /// buffer: by `AllReduceAlgorithm as usize` (LL lines, or pieces), then
    /// `GemmDtype as usize`.
    pub const REDUCE_SCATTER: [[&str; 3]; 2] = [
        ["symm_rs_one_shot_f32", "symm_rs_one_shot_bf16", "symm_rs_one_shot_f16"],
        ["symm_rs_two_shot_f32", "symm_rs_two_shot_bf16", "symm_rs_two_shot_f16"],
    ];
    /// kernels/allreduce.cu, by `GemmDtype as usize`.
    pub const ADD_RMSNORM: [&str; 3] = ["symm_add_rmsnorm_f32", "symm_add_rmsnorm_bf16", "symm_add_rmsnorm_f16"];
    /// kernels/pack.cu, contiguous rows copied with 2^i-byte accesses.
    pub const PACK_ROWS: [&str; 5] =
        ["symm_pack_rows_v1", "symm_pack_rows_v2", "symm_pack_rows_v4", "symm_pack_rows_v8", "symm_pack_rows_v16"];
    /// kernels/pack.cu, strided rows of 2^i-byte elements.
    pub const PACK_STRIDED: [&str; 4] =
        ["symm_pack_strided_e1", "symm_pack_strided_e2", "symm_pack_strided_e4", "symm_pack_strided_e8"];
    /// kernels/quantize.cu, by format (E4M3, E5M2).
    pub const QUANTIZE: [&str; 2] = ["symm_quantize_e4m3", "symm_quantize_e5m2"];
    /// kernels/pack.cu, tiled transposes of 2^i-byte elements.
    pub const PACK_TILED: [&str; 4] =
        ["symm_pack_tiled_e1", "symm_pack_tiled_e2", "symm_pack_tiled_e4", "symm_pack_tiled_e8"];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_embedded() {
        let names: Vec<&str> = sources().iter().map(|(n, _)| *n).collect();
        assert!(names.contains(&"common.cuh"));
        assert!(names.contains(&"signal.cu"));
        assert!(names.contains(&"reduce.cu"));
        assert!(names.contains(&"pack.cu"));
        assert!(unity_source().contains("#include \"signal.cu\""));
        for (_, text) in sources() {
            assert!(!text.is_empty());
        }
    }

    #[test]
    fn fatbins_match_cfg() {
        let units: Vec<&str> = sources().iter().map(|(n, _)| *n).filter(|n| n.ends_with(".cu")).collect();
        let built: Vec<&str> = fatbins().map(|(unit, _)| unit).collect();
        if cfg!(symm_fatbin) {
            assert_eq!(built, units, "one fatbin per kernels/*.cu");
        } else {
            assert!(built.is_empty());
        }
        for (_, f) in fatbins() {
            // Fatbin container magic 0xBA55ED50, little endian.
            assert_eq!(&f[..4], &[0x50, 0xED, 0x55, 0xBA]);
            assert_eq!(f.as_ptr() as usize % 16, 0);
        }
        assert!(!build_info().is_empty());
    }

    #[test]
    fn every_named_unit_is_a_kernel_source() {
        use names::units::*;
        for unit in [SIGNAL, REDUCE, PACK, GEMM_SM90, GEMM_SM90_RS, ALL_REDUCE, QUANTIZE] {
            assert!(sources().iter().any(|(n, _)| *n == unit), "kernels/{unit} missing");
        }
    }
}

/// The build script's cache keying, tested here since build scripts have no
/// test harness of their own.
#[cfg(test)]
#[path = "../../../build/kernel_cache.rs"]
#[allow(dead_code)]
mod build_kernel_cache;
