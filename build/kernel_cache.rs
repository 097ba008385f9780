//! Where build.rs keeps compiled kernels between builds, and under which key.
//!
//! A unit's fatbin depends on its `.cu`, the headers (any unit may include
//! any `.cuh`), the nvcc release and the flags; not on the cargo profile or
//! the checkout's path. Keyed by exactly those, one compile serves clippy,
//! `cargo test`, `cargo build --release` and a wheel build alike, and a
//! changed unit recompiles alone. Entries are published by rename, so a
//! concurrent build sees either no entry or a complete one.

use std::path::{Path, PathBuf};

/// Bumped when what an entry holds changes meaning.
const FORMAT: &str = "symm-kernels 1";

/// FNV-1a, 128 bits: stable across Rust releases (std's hasher is not) and
/// needs no dependency. Not cryptographic; it only has to tell builds apart.
pub struct Fnv128(u128);

impl Default for Fnv128 {
    fn default() -> Self {
        Fnv128(0x6c62_272e_07bb_0142_62b8_2175_6295_c58d)
    }
}

impl Fnv128 {
    /// Hashes `bytes` length-first, so ("ab", "c") and ("a", "bc") differ.
    pub fn field(&mut self, bytes: &[u8]) {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= u128::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
        }
    }

    pub fn hex(&self) -> String {
        format!("{:032x}", self.0)
    }
}

/// The key of compiling `unit` (a `.cu` of `files`, which are (name,
/// content) of every kernel file) with `compiler` (nvcc's `--version` text
/// and anything else that changes its output) and `flags`.
pub fn unit_key(unit: &str, files: &[(String, Vec<u8>)], compiler: &str, flags: &[String]) -> String {
    let mut h = Fnv128::default();
    h.field(FORMAT.as_bytes());
    h.field(unit.as_bytes());
    h.field(compiler.as_bytes());
    for flag in flags {
        h.field(flag.as_bytes());
    }
    for (name, text) in files.iter().filter(|(name, _)| name == unit || name.ends_with(".cuh")) {
        h.field(name.as_bytes());
        h.field(text);
    }
    h.hex()
}

/// The cache directory: `explicit` (`$SYMM_KERNEL_CACHE`) when set, else
/// `symm-kernels/` in cargo's target directory.
pub fn cache_dir(explicit: Option<PathBuf>, target_dir_env: Option<PathBuf>, out_dir: &Path) -> PathBuf {
    match explicit.filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => dir,
        None => target_dir(target_dir_env, out_dir).join("symm-kernels"),
    }
}

/// `$CARGO_TARGET_DIR` when set to an absolute path (a relative one is
/// relative to wherever cargo was started, unknown here), else found from
/// OUT_DIR, which is `<target>/[<triple>/]<profile>/build/<pkg>-<hash>/out`:
/// the nearest ancestor holding the `CACHEDIR.TAG` cargo writes at the
/// target directory's root, else the profile directory's parent.
pub fn target_dir(target_dir_env: Option<PathBuf>, out_dir: &Path) -> PathBuf {
    if let Some(dir) = target_dir_env.filter(|d| d.is_absolute()) {
        return dir;
    }
    out_dir
        .ancestors()
        .find(|a| a.join("CACHEDIR.TAG").is_file())
        .or_else(|| out_dir.ancestors().nth(4))
        .unwrap_or(out_dir)
        .to_path_buf()
}

/// The entry of `unit` ("gemm_sm90.cu") under `key` in `dir`.
pub fn entry(dir: &Path, unit: &str, key: &str) -> PathBuf {
    let stem = unit.strip_suffix(".cu").unwrap_or(unit);
    dir.join(format!("{stem}-{key}.fatbin"))
}

/// Where to write `entry` before publishing it: in the same directory (so
/// the rename is atomic) and unique to this process.
pub fn temp_path(entry: &Path) -> PathBuf {
    let name = entry.file_name().expect("an entry has a file name").to_string_lossy();
    entry.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> Vec<(String, Vec<u8>)> {
        [("a.cu", "A"), ("b.cu", "B"), ("common.cuh", "H")]
            .iter()
            .map(|(n, t)| (n.to_string(), t.as_bytes().to_vec()))
            .collect()
    }

    fn flags() -> Vec<String> {
        vec!["-O3".into(), "-gencode=arch=compute_90a,code=sm_90a".into()]
    }

    fn with(mut files: Vec<(String, Vec<u8>)>, name: &str, text: &str) -> Vec<(String, Vec<u8>)> {
        match files.iter_mut().find(|(n, _)| n == name) {
            Some(f) => f.1 = text.as_bytes().to_vec(),
            None => files.push((name.into(), text.as_bytes().to_vec())),
        }
        files
    }

    #[test]
    fn key_is_stable_and_hex() {
        let k = unit_key("a.cu", &files(), "V13.0.88", &flags());
        assert_eq!(k, unit_key("a.cu", &files(), "V13.0.88", &flags()));
        assert_eq!(k.len(), 32);
        assert!(k.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(k, unit_key("b.cu", &files(), "V13.0.88", &flags()));
    }

    #[test]
    fn key_follows_what_changes_the_fatbin() {
        let k =
            |files: &[(String, Vec<u8>)], compiler: &str, flags: &[String]| unit_key("a.cu", files, compiler, flags);
        let base = k(&files(), "V13.0.88", &flags());
        // The unit, any header (a new one too), the compiler, the flags.
        assert_ne!(base, k(&with(files(), "a.cu", "A2"), "V13.0.88", &flags()));
        assert_ne!(base, k(&with(files(), "common.cuh", "H2"), "V13.0.88", &flags()));
        assert_ne!(base, k(&with(files(), "new.cuh", ""), "V13.0.88", &flags()));
        assert_ne!(base, k(&files(), "V13.0.89", &flags()));
        assert_ne!(base, k(&files(), "V13.0.88", &flags()[..1]));
        // Not another unit.
        assert_eq!(base, k(&with(files(), "b.cu", "B2"), "V13.0.88", &flags()));
        assert_eq!(base, k(&with(files(), "c.cu", "C"), "V13.0.88", &flags()));
    }

    #[test]
    fn fields_are_delimited() {
        let hash = |parts: &[&str]| {
            let mut h = Fnv128::default();
            parts.iter().for_each(|p| h.field(p.as_bytes()));
            h.hex()
        };
        assert_ne!(hash(&["ab", "c"]), hash(&["a", "bc"]));
        assert_ne!(hash(&[""]), hash(&[]));
    }

    #[test]
    fn cache_dir_choice() {
        let out = Path::new("/t/release/build/symm-0123/out");
        assert_eq!(cache_dir(Some("/c".into()), None, out), Path::new("/c"));
        assert_eq!(cache_dir(Some("".into()), Some("/e".into()), out), Path::new("/e/symm-kernels"));
        // A relative CARGO_TARGET_DIR is ignored; no CACHEDIR.TAG under /t.
        assert_eq!(cache_dir(None, Some("rel".into()), out), Path::new("/t/symm-kernels"));
    }

    #[test]
    fn target_dir_is_found_from_out_dir() {
        let root = std::env::temp_dir().join(format!("symm-kernel-cache-test-{}", std::process::id()));
        let out = root.join("x86_64-unknown-linux-gnu/release/build/symm-0123/out");
        std::fs::create_dir_all(&out).unwrap();
        // Without the tag: the profile directory's parent (here the triple's directory).
        assert_eq!(target_dir(None, &out), root.join("x86_64-unknown-linux-gnu"));
        std::fs::write(root.join("CACHEDIR.TAG"), "").unwrap();
        assert_eq!(target_dir(None, &out), root);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn entry_and_temp_path() {
        let e = entry(Path::new("/c"), "gemm_sm90.cu", "00ff");
        assert_eq!(e, Path::new("/c/gemm_sm90-00ff.fatbin"));
        let t = temp_path(&e);
        assert_eq!(t.parent(), e.parent());
        assert_ne!(t, e);
    }
}
