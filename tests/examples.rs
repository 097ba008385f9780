//! The C examples of `examples-c/`, built by their own Makefile against the
//! libsymm.so cargo just built and run as 2 ranks on the host backend, so
//! that what users copy from keeps compiling and keeps computing right.

mod common;

use common::{lib_dir, root};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Runs `make` once for every test of this binary; returns the build dir.
fn built() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let build = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("examples-c");
        let out = Command::new("make")
            .arg("-C")
            .arg(root().join("examples-c"))
            .arg(format!("SYMM_LIB={}", lib_dir().display()))
            .arg(format!("BUILD={}", build.display()))
            .arg("CFLAGS=-O1 -g -Wall -Wextra -Werror -pedantic -std=c11")
            .output()
            .expect("running make");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "make -C examples-c failed:\n{text}");
        build
    })
}

/// Runs an example as 2 ranks; every rank must report `expect`.
fn run_example(name: &str, expect: &str) {
    let out = Command::new(built().join(name))
        .args(["--world-size", "2"])
        .env("SYMM_BACKEND", "host")
        .env_remove("RANK")
        .output()
        .expect("starting the example");
    let text = String::from_utf8_lossy(&out.stdout);
    let errors = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} failed:\n{text}{errors}");
    assert_eq!(text.lines().filter(|l| l.contains(expect)).count(), 2, "{name}:\n{text}{errors}");
}

#[test]
fn signals() {
    run_example("signals", "got \"hello from rank");
}

#[test]
fn ag_mm() {
    run_example("ag_mm", ": ok");
}

#[test]
fn mm_rs() {
    run_example("mm_rs", ": ok");
}

#[test]
fn lc_allgather() {
    run_example("lc_allgather", ": ok");
}

#[test]
fn all_reduce() {
    run_example("all_reduce", ": ok");
}
