//! The C API from C: builds the programs of `ffi-tests/` against
//! `include/symm.h` and the `libsymm.so` cargo just built, and runs them as
//! 1 to 4 ranks over every bootstrap. A rank that hangs is killed by the
//! program's own launcher (`--deadline`), so a hang fails, never stalls.

mod common;

use common::{lib_dir, root};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Compiles one C or C++ file into an executable linked with libsymm, once
/// per test binary even when tests run in parallel.
fn build(src: &str, std: &str) -> PathBuf {
    static BUILT: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(exe) = built.get(src) {
        return exe.clone();
    }
    let exe = compile(src, std);
    built.insert(src.to_string(), exe.clone());
    exe
}

fn compile(src: &str, std: &str) -> PathBuf {
    // symm is Linux-only (memfd, SCM_RIGHTS, CUDA VMM fds).
    let target = &format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let cpp = src.ends_with(".cpp");
    let compiler = cc::Build::new()
        .cpp(cpp)
        .target(target)
        .host(target)
        .opt_level(1)
        .cargo_metadata(false)
        .cargo_warnings(false)
        .get_compiler();
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ffi-tests");
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join(Path::new(src).file_stem().unwrap());
    let lib = lib_dir();
    let status = compiler
        .to_command()
        .args([&format!("-std={std}"), "-Wall", "-Wextra", "-Werror", "-pedantic", "-g"])
        .arg("-I")
        .arg(root().join("include"))
        .arg("-I")
        .arg(root().join("examples-c"))
        .arg(root().join("ffi-tests").join(src))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lsymm", "-lpthread", "-lm"])
        .status()
        .expect("running the C compiler");
    assert!(status.success(), "compiling ffi-tests/{src} failed");
    exe
}

/// Runs a program with arguments; the run must exit 0.
fn run(exe: &Path, args: &[&str]) {
    run_with_env(exe, args, &[]);
}

fn run_with_env(exe: &Path, args: &[&str], env: &[(&str, &str)]) {
    let out = Command::new(exe)
        .args(args)
        .env("SYMM_BACKEND", "host")
        .env_remove("RANK")
        .env_remove("SYMM_CHECK_ARGS")
        .envs(env.iter().copied())
        .output()
        .expect("starting the test program");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{} {}:\n{text}", exe.display(), args.join(" "));
}

fn worlds_and_modes(src: &str, worlds: &[usize], modes: &[&str]) {
    let exe = build(src, "c11");
    for mode in modes {
        for w in worlds {
            run(&exe, &["--world-size", &w.to_string(), "--mode", mode, "--deadline", "60"]);
        }
    }
}

#[test]
fn header_compiles_as_c99_and_cxx() {
    run(&build("header_c99.c", "c99"), &[]);
    run(&build("header_cxx.cpp", "c++11"), &[]);
}

#[test]
fn api_contract() {
    run(&build("test_api.c", "c11"), &[]);
}

#[test]
fn log_callback_and_build_info() {
    run(&build("test_log.c", "c11"), &[]);
}

#[test]
fn memory_unique_id() {
    worlds_and_modes("test_memory.c", &[1, 2, 3, 4], &["uid"]);
}

#[test]
fn memory_env() {
    worlds_and_modes("test_memory.c", &[1, 2, 3, 4], &["env"]);
}

#[test]
fn memory_callback() {
    worlds_and_modes("test_memory.c", &[1, 2, 3, 4], &["callback"]);
}

#[test]
fn memory_in_process() {
    worlds_and_modes("test_memory.c", &[1, 2, 3, 4], &["local"]);
}

/// Tensor parallelism runs at 8 ranks per node: the host backend at world 8,
/// as processes and in one process (the GPU runs at 8 need 8-GPU machines).
#[test]
fn world_8() {
    worlds_and_modes("test_memory.c", &[8], &["uid", "local"]);
    worlds_and_modes("test_ops.c", &[8], &["uid", "local"]);
}

#[test]
fn missing_rank_is_named() {
    let exe = build("test_memory.c", "c11");
    for mode in ["uid", "env", "callback"] {
        run(&exe, &["--world-size", "3", "--mode", mode, "--skip-rank", "2", "--deadline", "60"]);
    }
}

#[test]
fn ops_unique_id() {
    worlds_and_modes("test_ops.c", &[1, 2, 3, 4], &["uid"]);
}

#[test]
fn ops_in_process() {
    worlds_and_modes("test_ops.c", &[1, 2, 3, 4], &["local"]);
}

/// Scaled fp8 matmuls and their argument checks, as processes and in-process.
#[test]
fn fp8_ops() {
    worlds_and_modes("test_fp8.c", &[1, 2, 3, 4], &["uid", "local"]);
}

/// Checking arguments on every call catches ranks that disagree on a call
/// whose arguments were agreed before.
#[test]
fn ops_check_args_always() {
    let exe = build("test_ops.c", "c11");
    let args = ["--world-size", "3", "--mode", "uid", "--deadline", "60"];
    run_with_env(&exe, &args, &[("SYMM_CHECK_ARGS", "always")]);
}

#[test]
fn no_leak_over_10000_rounds() {
    let exe = build("test_leak.c", "c11");
    run(&exe, &["--world-size", "2", "--mode", "uid", "--deadline", "300"]);
}
