//! Compiles `kernels/*.cu` into one fatbin embedded in the library, and
//! always embeds the kernel sources for the run-time NVRTC fallback.
//!
//! nvcc is looked for, in order, at:
//!   1. `$NVCC` (when set, only there: a path that is not an executable file
//!      means "no nvcc", which is how the NVRTC fallback build is tested);
//!   2. `$CUDA_HOME/bin/nvcc`;
//!   3. `nvcc` on `$PATH`;
//!   4. the pinned PyPI wheels installed by `.ci/install-nvcc.sh` into
//!      `$SYMM_NVCC_DIR` (default `<crate>/.venv/nvcc`), or a virtual
//!      environment at `<crate>/.venv` that holds them.
//!
//! Nothing is ever installed from here.
//!
//! With nvcc: all `.cu` files are compiled as one translation unit into
//! `$OUT_DIR/symm_kernels.fatbin` (SASS for sm_80, sm_90, sm_90a, sm_100 and
//! PTX for compute_90) and `cfg(symm_fatbin)` is set. A compile error fails
//! the build. nvcc must be 13.0.x: PTX from a newer nvcc does not load on
//! driver 580 (CUDA 13.0).
//! Without nvcc: one warning, no `cfg(symm_fatbin)`; `SYMM_REQUIRE_NVCC=1`
//! (set in CI) turns a missing or too new nvcc into an error.
//!
//! Always: `$OUT_DIR/symm_kernel_sources.rs` (see src/backend/cuda/kernels.rs)
//! and `SYMM_KERNELS_BUILD`, a one-line description of how kernels were built.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The nvcc release whose PTX driver 580 accepts.
const NVCC_RELEASE: (u32, u32) = (13, 0);

/// (virtual architecture, real target): SASS for each, PTX for compute_90.
const GENCODE: &[(&str, &str)] = &[
    ("compute_80", "sm_80"),
    ("compute_90", "sm_90"),
    ("compute_90a", "sm_90a"),
    ("compute_100", "sm_100"),
    ("compute_90", "compute_90"),
];

const FATBIN: &str = "symm_kernels.fatbin";
const UNITY_SOURCE: &str = "symm_kernels.cu";
const SOURCES_RS: &str = "symm_kernel_sources.rs";

fn main() {
    declare_inputs();
    let crate_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let kernel_dir = crate_dir.join("kernels");
    let files = kernel_files(&kernel_dir);
    let units: Vec<&str> = files.iter().map(|(name, _)| name.as_str()).filter(|n| n.ends_with(".cu")).collect();

    write_file(&out_dir.join(SOURCES_RS), &sources_rs(&files, &units));
    write_file(&out_dir.join(UNITY_SOURCE), &unity_source(&kernel_dir, &units));
    println!("cargo::rustc-check-cfg=cfg(symm_fatbin)");

    match find_nvcc(&crate_dir) {
        Ok(nvcc) => build_fatbin(&nvcc, &kernel_dir, &out_dir),
        Err(why) => no_nvcc(&why),
    }
}

fn declare_inputs() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    for var in [
        "NVCC",
        "CUDA_HOME",
        "PATH",
        "SYMM_NVCC_DIR",
        "SYMM_REQUIRE_NVCC",
        // Read by nvcc itself.
        "NVCC_CCBIN",
        "NVCC_PREPEND_FLAGS",
        "NVCC_APPEND_FLAGS",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
}

fn require_nvcc() -> bool {
    matches!(
        env::var("SYMM_REQUIRE_NVCC").unwrap_or_default().trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

// ---------------------------------------------------------------------------
// Kernel sources
// ---------------------------------------------------------------------------

/// (file name, path) of every `.cu` and `.cuh` in `dir`, sorted by name.
fn kernel_files(dir: &Path) -> Vec<(String, PathBuf)> {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    let mut files: Vec<(String, PathBuf)> = entries
        .map(|e| e.expect("reading kernels/").path())
        .filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("cu" | "cuh")))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    files.sort();
    files
}

/// Rust source defining `KERNEL_SOURCES` (every file, by name) and
/// `KERNEL_UNITY_SOURCE` (the one translation unit, in NVRTC form: it
/// includes the `.cu` files by bare name, to be served as in-memory headers).
fn sources_rs(files: &[(String, PathBuf)], units: &[&str]) -> String {
    let mut rs = String::from("pub static KERNEL_SOURCES: &[(&str, &str)] = &[\n");
    for (name, path) in files {
        let path = path.to_str().expect("kernel path is not UTF-8");
        writeln!(rs, "    ({name:?}, include_str!({path:?})),").unwrap();
    }
    rs.push_str("];\n");
    let unity: String = units.iter().map(|u| format!("#include \"{u}\"\n")).collect();
    writeln!(rs, "pub static KERNEL_UNITY_SOURCE: &str = {unity:?};").unwrap();
    rs
}

/// The translation unit nvcc compiles: every `.cu`, by absolute path.
fn unity_source(kernel_dir: &Path, units: &[&str]) -> String {
    units.iter().map(|u| format!("#include \"{}\"\n", kernel_dir.join(u).display())).collect()
}

fn write_file(path: &Path, text: &str) {
    // Leave an unchanged file alone so its timestamp does not move.
    if fs::read_to_string(path).ok().as_deref() != Some(text) {
        fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }
}

// ---------------------------------------------------------------------------
// Finding nvcc
// ---------------------------------------------------------------------------

fn find_nvcc(crate_dir: &Path) -> Result<PathBuf, String> {
    if let Some(nvcc) = env::var_os("NVCC") {
        let nvcc = PathBuf::from(nvcc);
        return if is_executable(&nvcc) {
            Ok(nvcc)
        } else {
            Err(format!("NVCC={} is not an executable file", nvcc.display()))
        };
    }
    let candidates = cuda_home_nvcc().into_iter().chain(path_nvcc()).chain(wheel_nvcc(crate_dir));
    for nvcc in candidates {
        if is_executable(&nvcc) {
            return Ok(nvcc);
        }
    }
    Err("no nvcc in NVCC, CUDA_HOME, PATH or the wheels of .ci/install-nvcc.sh".into())
}

fn cuda_home_nvcc() -> Option<PathBuf> {
    env::var_os("CUDA_HOME").map(|home| PathBuf::from(home).join("bin").join("nvcc"))
}

fn path_nvcc() -> Vec<PathBuf> {
    env::var_os("PATH").map(|p| env::split_paths(&p).map(|d| d.join("nvcc")).collect()).unwrap_or_default()
}

/// nvcc of the pinned wheels: `.ci/install-nvcc.sh` installs them with
/// `pip install --target $SYMM_NVCC_DIR` (default `<crate>/.venv/nvcc`); a
/// virtual environment at `<crate>/.venv` holding them is accepted too.
fn wheel_nvcc(crate_dir: &Path) -> Vec<PathBuf> {
    const NVCC: &str = "nvidia/cu13/bin/nvcc";
    let target = env::var_os("SYMM_NVCC_DIR").map(PathBuf::from).unwrap_or_else(|| crate_dir.join(".venv/nvcc"));
    let mut found = vec![target.join(NVCC)];
    if let Ok(libs) = fs::read_dir(crate_dir.join(".venv/lib")) {
        let mut venv: Vec<PathBuf> = libs
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
            .map(|e| e.path().join("site-packages").join(NVCC))
            .collect();
        venv.sort();
        found.extend(venv);
    }
    found
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

// ---------------------------------------------------------------------------
// Compiling
// ---------------------------------------------------------------------------

fn no_nvcc(why: &str) {
    if require_nvcc() {
        fail(&format!("SYMM_REQUIRE_NVCC is set but {why}; run .ci/install-nvcc.sh or set NVCC"));
    }
    println!(
        "cargo::warning={why}; kernels will be compiled at run time with NVRTC. \
         To embed a fatbin, run .ci/install-nvcc.sh (or set NVCC) and rebuild after `touch build.rs`."
    );
    println!("cargo::rustc-env=SYMM_KERNELS_BUILD=sources only (NVRTC at run time)");
}

fn build_fatbin(nvcc: &Path, kernel_dir: &Path, out_dir: &Path) {
    println!("cargo::rerun-if-changed={}", nvcc.display());
    let version = nvcc_version(nvcc);
    check_version(nvcc, &version);

    let output = Command::new(nvcc)
        .args(nvcc_args(kernel_dir, out_dir))
        .current_dir(out_dir)
        .output()
        .unwrap_or_else(|e| fail(&format!("running {}: {e}", nvcc.display())));
    let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if !output.status.success() {
        fail(&format!("{} failed ({}) compiling kernels/:\n{log}", nvcc.display(), output.status));
    }
    // Compiler warnings: show them (once, not once per target), do not fail.
    let mut seen = std::collections::HashSet::new();
    for line in log.lines().filter(|l| !l.trim().is_empty() && seen.insert(*l)) {
        println!("cargo::warning=nvcc: {line}");
    }
    println!("cargo::rustc-cfg=symm_fatbin");
    println!("cargo::rustc-env=SYMM_KERNELS_BUILD=fatbin by nvcc {version} ({})", nvcc.display());
}

fn nvcc_args(kernel_dir: &Path, out_dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "-fatbin",
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        "--threads=0",
        "-Xptxas=-warn-spills",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(format!("-I{}", kernel_dir.display()));
    for (arch, code) in GENCODE {
        args.push(format!("-gencode=arch={arch},code={code}"));
    }
    args.push("-o".into());
    args.push(out_dir.join(FATBIN).display().to_string());
    args.push(out_dir.join(UNITY_SOURCE).display().to_string());
    args
}

/// "13.0.88" from `nvcc --version` ("... release 13.0, V13.0.88").
fn nvcc_version(nvcc: &Path) -> String {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| fail(&format!("running {} --version: {e}", nvcc.display())));
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .filter_map(|w| w.strip_prefix('V'))
        .find(|v| v.split('.').count() == 3 && v.split('.').all(|n| n.parse::<u32>().is_ok()))
        .map(str::to_owned)
        .unwrap_or_else(|| fail(&format!("cannot read the version from `{} --version`:\n{text}", nvcc.display())))
}

fn check_version(nvcc: &Path, version: &str) {
    let mut parts = version.split('.').map(|n| n.parse::<u32>().unwrap());
    let release = (parts.next().unwrap(), parts.next().unwrap());
    if release <= NVCC_RELEASE {
        return;
    }
    let msg = format!(
        "{} is nvcc {version}, newer than {}.{}: its PTX will NOT load on driver 580 (CUDA 13.0); \
         use the pinned nvcc of .ci/install-nvcc.sh",
        nvcc.display(),
        NVCC_RELEASE.0,
        NVCC_RELEASE.1
    );
    if require_nvcc() {
        fail(&msg);
    }
    println!("cargo::warning=WARNING: {msg}");
}

fn fail(msg: &str) -> ! {
    eprintln!("error: symm build script: {msg}");
    std::process::exit(1);
}
