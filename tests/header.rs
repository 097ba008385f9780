//! `include/symm.h` is generated from `src/ffi` by cbindgen and committed, so
//! that users need neither cbindgen nor Rust to read it. This test
//! regenerates it and fails on any difference; `SYMM_BLESS=1` rewrites it.

use std::path::Path;

#[test]
fn header_matches_source() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_src(root.join("src/ffi/mod.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen failed on src/ffi")
        .write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = root.join("include/symm.h");
    if std::env::var_os("SYMM_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/symm.h is out of date with src/ffi; regenerate it with `SYMM_BLESS=1 cargo test --test header` and commit it"
    );
}
