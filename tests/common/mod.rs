//! Shared by the integration tests that build and run C programs.

use std::path::{Path, PathBuf};

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where cargo put libsymm.so: the profile dir above this test's `deps/`.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(
        dir.join("libsymm.so").exists(),
        "libsymm.so not found in {}: `cargo test` does not build the cdylib; run `cargo build` (same profile) first, or .ci/test",
        dir.display()
    );
    dir
}
