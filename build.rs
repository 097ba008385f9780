//! Compiles each `kernels/*.cu` into a fatbin embedded in the library, and
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
//! With nvcc: every `.cu` is its own translation unit (the `.cuh` files are
//! headers), compiled into one fatbin per unit (SASS for sm_80, sm_90,
//! sm_90a, sm_100 and PTX for compute_90), the units concurrently, and
//! `cfg(symm_fatbin)` is set. The runtime loads each fatbin as a module. A
//! compile error fails the build. nvcc must be 13.0.x: PTX from a newer nvcc
//! does not load on driver 580 (CUDA 13.0).
//! Compiled fatbins are cached outside OUT_DIR, in `$SYMM_KERNEL_CACHE` or
//! else `<target dir>/symm-kernels/`, keyed by the unit, the headers, nvcc's
//! version and the flags (build/kernel_cache.rs): another profile, clippy, or
//! a rerun of this script reuses them without running nvcc.
//! Without nvcc: one warning, no `cfg(symm_fatbin)`; `SYMM_REQUIRE_NVCC=1`
//! (set in CI) turns a missing or too new nvcc into an error.
//!
//! Always: `$OUT_DIR/symm_kernel_sources.rs` and
//! `$OUT_DIR/symm_kernel_fatbins.rs` (see src/backend/cuda/kernels.rs) and
//! `SYMM_KERNELS_BUILD`, a one-line description of how kernels were built.
//!
//! Also: the cdylib's SONAME, `libsymm.so.<major>`, and the link of that
//! name to libsymm.so in cargo's profile directory (`soname` below).

#[path = "build/kernel_cache.rs"]
mod kernel_cache;

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

/// nvcc's flags besides the gencode list, include path, output and input.
const NVCC_FLAGS: &[&str] = &[
    "-fatbin",
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    // Targets in parallel, and each target's functions in parallel (ptxas
    // of sm_90a's matmul kernels is most of the build).
    "--threads=0",
    "--split-compile=0",
    "-Xptxas=-warn-spills",
];

const SOURCES_RS: &str = "symm_kernel_sources.rs";
const FATBINS_RS: &str = "symm_kernel_fatbins.rs";

fn main() {
    declare_inputs();
    let crate_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let kernel_dir = crate_dir.join("kernels");
    let files = kernel_files(&kernel_dir);
    let units: Vec<&str> = files.iter().map(|(name, _)| name.as_str()).filter(|n| n.ends_with(".cu")).collect();

    write_file(&out_dir.join(SOURCES_RS), sources_rs(&files, &units).as_bytes());
    println!("cargo::rustc-check-cfg=cfg(symm_fatbin)");

    let fatbins = match find_nvcc(&crate_dir) {
        Ok(nvcc) => build_fatbins(&nvcc, &kernel_dir, &files, &units, &out_dir),
        Err(why) => {
            no_nvcc(&why);
            Vec::new()
        }
    };
    write_file(&out_dir.join(FATBINS_RS), fatbins_rs(&fatbins).as_bytes());
    soname(&out_dir);
}

// ---------------------------------------------------------------------------
// The shared library's name
// ---------------------------------------------------------------------------

/// Gives libsymm.so the SONAME `libsymm.so.<major>`: programs linked with
/// it then ask for `libsymm.so.<major>` at run time, which the install
/// (scripts/install.sh) provides as a link to `libsymm.so.<version>`.
/// So that programs linked in the build tree (ffi-tests, examples-c) find
/// that name too, the profile directory cargo puts libsymm.so into gets the
/// link `libsymm.so.<major> -> libsymm.so` (the profile directory is
/// OUT_DIR's `<profile>/build/<pkg>-<hash>/out` minus three levels).
fn soname(out_dir: &Path) {
    let major = env::var("CARGO_PKG_VERSION_MAJOR").expect("CARGO_PKG_VERSION_MAJOR");
    let soname = format!("libsymm.so.{major}");
    println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    let build_dir = out_dir.parent().and_then(Path::parent).filter(|d| d.ends_with("build"));
    let Some(profile_dir) = build_dir.and_then(Path::parent) else {
        println!(
            "cargo::warning=OUT_DIR {} is not <profile>/build/<pkg>/out: no {soname} link next to libsymm.so",
            out_dir.display()
        );
        return;
    };
    let link = profile_dir.join(&soname);
    if fs::read_link(&link).ok().as_deref() != Some(Path::new("libsymm.so")) {
        let _ = fs::remove_file(&link);
        if let Err(e) = std::os::unix::fs::symlink("libsymm.so", &link) {
            println!("cargo::warning=creating {}: {e}", link.display());
        }
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
        "SYMM_KERNEL_CACHE",
        "CARGO_TARGET_DIR",
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

/// Rust source defining `KERNEL_FATBINS`: (unit, fatbin) of each compiled
/// unit, the images 16-byte aligned (`Aligned` is kernels.rs's).
fn fatbins_rs(fatbins: &[(&str, PathBuf)]) -> String {
    let mut rs = String::new();
    for (i, (_, path)) in fatbins.iter().enumerate() {
        let path = path.to_str().expect("OUT_DIR is not UTF-8");
        writeln!(rs, "static FATBIN_{i}: &super::Aligned<[u8]> = &super::Aligned(*include_bytes!({path:?}));").unwrap();
    }
    rs.push_str("pub static KERNEL_FATBINS: &[(&str, &super::Aligned<[u8]>)] = &[\n");
    for (i, (unit, _)) in fatbins.iter().enumerate() {
        writeln!(rs, "    ({unit:?}, FATBIN_{i}),").unwrap();
    }
    rs.push_str("];\n");
    rs
}

fn write_file(path: &Path, bytes: &[u8]) {
    // Leave an unchanged file alone so its timestamp does not move.
    if fs::read(path).ok().as_deref() != Some(bytes) {
        fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
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

/// Compiles (or finds in the cache) each unit's fatbin, copies it into
/// OUT_DIR and returns (unit, path there).
fn build_fatbins<'a>(
    nvcc: &Path,
    kernel_dir: &Path,
    files: &[(String, PathBuf)],
    units: &[&'a str],
    out_dir: &Path,
) -> Vec<(&'a str, PathBuf)> {
    println!("cargo::rerun-if-changed={}", nvcc.display());
    let version_text = nvcc_version_text(nvcc);
    let version = nvcc_version(nvcc, &version_text);
    check_version(nvcc, &version);

    let flags = nvcc_flags();
    // nvcc's own environment changes its output as flags do.
    let mut compiler = version_text;
    for var in ["NVCC_CCBIN", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"] {
        let value = env::var_os(var).unwrap_or_default();
        write!(compiler, "\n{var}={}", value.to_string_lossy()).unwrap();
    }
    let contents: Vec<(String, Vec<u8>)> = files
        .iter()
        .map(|(name, path)| {
            (name.clone(), fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display())))
        })
        .collect();
    let cache = kernel_cache::cache_dir(
        env::var_os("SYMM_KERNEL_CACHE").map(PathBuf::from),
        env::var_os("CARGO_TARGET_DIR").map(PathBuf::from),
        out_dir,
    );
    fs::create_dir_all(&cache).unwrap_or_else(|e| fail(&format!("creating {}: {e}", cache.display())));
    let entries: Vec<(&str, PathBuf)> = units
        .iter()
        .map(|&unit| {
            (unit, kernel_cache::entry(&cache, unit, &kernel_cache::unit_key(unit, &contents, &compiler, &flags)))
        })
        .collect();

    compile_missing(nvcc, kernel_dir, &flags, &entries);

    println!("cargo::rustc-cfg=symm_fatbin");
    println!("cargo::rustc-env=SYMM_KERNELS_BUILD=fatbin by nvcc {version} ({})", nvcc.display());
    entries
        .into_iter()
        .map(|(unit, entry)| {
            let image = fs::read(&entry).unwrap_or_else(|e| fail(&format!("reading {}: {e}", entry.display())));
            let copy = out_dir.join(format!("{}.fatbin", unit.trim_end_matches(".cu")));
            write_file(&copy, &image);
            (unit, copy)
        })
        .collect()
}

/// Compiles the units whose cache entry is missing, all at once (each nvcc
/// also runs its targets in parallel; the largest unit dominates anyway),
/// and publishes each entry by renaming a finished temporary file.
fn compile_missing(nvcc: &Path, kernel_dir: &Path, flags: &[String], entries: &[(&str, PathBuf)]) {
    let missing: Vec<&(&str, PathBuf)> = entries.iter().filter(|(_, entry)| !entry.is_file()).collect();
    let results: Vec<(&str, Result<String, String>)> = std::thread::scope(|s| {
        let running: Vec<_> = missing
            .iter()
            .map(|(unit, entry)| (*unit, s.spawn(move || compile_unit(nvcc, kernel_dir, flags, unit, entry))))
            .collect();
        running.into_iter().map(|(unit, job)| (unit, job.join().expect("compile thread panicked"))).collect()
    });
    let mut failed = String::new();
    for (unit, result) in results {
        match result {
            // Compiler warnings: show them (once, not once per target), do not fail.
            Ok(log) => {
                let mut seen = std::collections::HashSet::new();
                for line in log.lines().filter(|l| !l.trim().is_empty() && seen.insert(*l)) {
                    println!("cargo::warning=nvcc ({unit}): {line}");
                }
            }
            Err(why) => failed.push_str(&why),
        }
    }
    if !failed.is_empty() {
        fail(&failed);
    }
}

/// nvcc on one unit into a temporary file, renamed to `entry` on success.
/// Ok: nvcc's output (warnings); Err: why it failed.
fn compile_unit(nvcc: &Path, kernel_dir: &Path, flags: &[String], unit: &str, entry: &Path) -> Result<String, String> {
    let temp = kernel_cache::temp_path(entry);
    let output = Command::new(nvcc)
        .args(flags)
        .arg(format!("-I{}", kernel_dir.display()))
        .arg("-o")
        .arg(&temp)
        .arg(kernel_dir.join(unit))
        .output()
        .map_err(|e| format!("running {}: {e}\n", nvcc.display()))?;
    let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if !output.status.success() {
        let _ = fs::remove_file(&temp);
        return Err(format!("{} failed ({}) compiling kernels/{unit}:\n{log}\n", nvcc.display(), output.status));
    }
    fs::rename(&temp, entry).map_err(|e| format!("renaming {} to {}: {e}\n", temp.display(), entry.display()))?;
    Ok(log)
}

/// The flags of every unit's compile, the gencode list included.
fn nvcc_flags() -> Vec<String> {
    let gencode = GENCODE.iter().map(|(arch, code)| format!("-gencode=arch={arch},code={code}"));
    NVCC_FLAGS.iter().map(|s| s.to_string()).chain(gencode).collect()
}

/// The text of `nvcc --version`.
fn nvcc_version_text(nvcc: &Path) -> String {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| fail(&format!("running {} --version: {e}", nvcc.display())));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// "13.0.88" from `nvcc --version` ("... release 13.0, V13.0.88").
fn nvcc_version(nvcc: &Path, text: &str) -> String {
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
