//! The library's environment variables (`SYMM_*`, and the launcher's
//! `RANK`, `WORLD_SIZE`, ... that the env bootstrap reads), read here and
//! nowhere else. README.md's "Environment variables" table lists them.
//!
//! Group settings (`SYMM_ALGO`, `SYMM_TIMEOUT_MS`, `SYMM_CHECK_ARGS`,
//! `SYMM_BACKEND`) are read once, when a group forms; the ones that change
//! what the ranks do together (the algorithm, the check-args mode) are then
//! agreed with the other ranks (`group::Settings`), so ranks started with
//! different environments fail at once with `Mismatch` naming the variable
//! instead of waiting for each other. Process settings (`SYMM_GRAPHS`,
//! `SYMM_GEMM_TUNE`) are read once per process: they change only how this
//! rank issues its work.
//! The library's own tests read theirs here too (`tests_env`); they
//! choose what a test process runs, the same in every rank of it.

use crate::backend::BackendChoice;
use crate::cost::Algorithm;
use crate::error::{err, Result};
use std::time::Duration;

pub const ALGO: &str = "SYMM_ALGO";
pub const TIMEOUT_MS: &str = "SYMM_TIMEOUT_MS";
pub const CHECK_ARGS: &str = "SYMM_CHECK_ARGS";
pub const BACKEND: &str = "SYMM_BACKEND";
pub const GRAPHS: &str = "SYMM_GRAPHS";
pub const GEMM_TUNE: &str = "SYMM_GEMM_TUNE";
pub const BOOTSTRAP_ADDR: &str = "SYMM_BOOTSTRAP_ADDR";
pub const BOOTSTRAP_PORT: &str = "SYMM_BOOTSTRAP_PORT";
pub const BOOTSTRAP_SECRET: &str = "SYMM_BOOTSTRAP_SECRET";
pub const DEBUG: &str = "SYMM_DEBUG";
pub const DEBUG_FILE: &str = "SYMM_DEBUG_FILE";
pub const HOST_ID: &str = "SYMM_HOST_ID";
pub const NCCL_LIBRARY: &str = "SYMM_NCCL_LIBRARY";

/// A variable's value; empty (or blank) counts as unset.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `SYMM_ALGO`: the algorithm every fused operation of a group runs
/// (`sequential`, `pipelined` or `fused`) unless a call's options choose
/// one; unset, the cost model chooses.
pub fn algorithm() -> Result<Option<Algorithm>> {
    var(ALGO)
        .map(|v| {
            Algorithm::parse(&v)
                .ok_or_else(|| err!(InvalidArgument, "{ALGO}={v:?}: expected sequential, pipelined or fused"))
        })
        .transpose()
}

/// `SYMM_TIMEOUT_MS`: how long a rank waits for the others.
pub fn timeout() -> Result<Option<Duration>> {
    var(TIMEOUT_MS)
        .map(|v| {
            v.trim()
                .parse::<u64>()
                .ok()
                .filter(|&ms| ms > 0)
                .map(Duration::from_millis)
                .ok_or_else(|| err!(InvalidArgument, "{TIMEOUT_MS}={v:?}: expected a positive number of milliseconds"))
        })
        .transpose()
}

/// `SYMM_CHECK_ARGS`: `always` (`Some(true)`: exchange every call's
/// arguments) or `cached` (`None`: as the group's config says).
pub fn check_args_always() -> Result<Option<bool>> {
    match var(CHECK_ARGS).map(|v| (v.trim().to_ascii_lowercase(), v)) {
        None => Ok(None),
        Some((l, _)) if l == "always" => Ok(Some(true)),
        Some((l, _)) if l == "cached" => Ok(None),
        Some((_, v)) => Err(err!(InvalidArgument, "{CHECK_ARGS}={v:?}: expected always or cached")),
    }
}

/// `SYMM_BACKEND`: `auto`, `cuda` or `host`.
pub fn backend() -> Result<Option<BackendChoice>> {
    var(BACKEND).map(|v| BackendChoice::parse(&v)).transpose()
}

/// `SYMM_GRAPHS=0` turns off the replay of repeated calls as captured
/// graphs (read once per process).
pub fn graphs() -> bool {
    static ON: once_cell::sync::Lazy<bool> = once_cell::sync::Lazy::new(|| {
        let on = var(GRAPHS).is_none_or(|v| v != "0");
        if !on {
            log::info!("SYMM_GRAPHS=0: repeated calls are not captured into CUDA graphs");
        }
        on
    });
    *ON
}

/// `SYMM_GEMM_TUNE=0` keeps cuBLASLt's first choice for every matmul
/// instead of timing its candidates for those of the sizes
/// `backend::cuda::gemm::tune` names (read once per process).
pub fn gemm_tune() -> bool {
    static ON: once_cell::sync::Lazy<bool> = once_cell::sync::Lazy::new(|| {
        let on = var(GEMM_TUNE).is_none_or(|v| v != "0");
        if !on {
            log::info!("SYMM_GEMM_TUNE=0: matmuls keep cuBLASLt's first choice");
        }
        on
    });
    *ON
}

/// `SYMM_HOST_ID`: the host identity this rank announces when a group
/// forms, instead of its hostname and boot id (ranks with different ids
/// count as on different hosts).
pub fn host_id() -> Option<String> {
    var(HOST_ID).map(|v| v.trim().to_string())
}

/// `SYMM_NCCL_LIBRARY`: the NCCL library to load for groups that span
/// hosts, before `libnccl.so.2` from the dynamic loader's search path.
pub fn nccl_library() -> Option<String> {
    var(NCCL_LIBRARY)
}

/// `SYMM_BOOTSTRAP_ADDR`: where an embedded bootstrap store listens.
pub fn bootstrap_addr() -> Option<String> {
    var(BOOTSTRAP_ADDR)
}

/// `SYMM_DEBUG` and `SYMM_DEBUG_FILE`, raw (the logger parses them once
/// per process; see `logging`). Unlike the others, an empty value is kept.
pub fn logging() -> LogSettings {
    let raw = |name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    LogSettings { debug: raw(DEBUG), debug_file: raw(DEBUG_FILE) }
}

/// The logging settings the environment holds, raw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogSettings {
    pub debug: Option<String>,
    pub debug_file: Option<String>,
}

/// A variable of the launcher's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `MASTER_ADDR`, `MASTER_PORT`, ...) or the env bootstrap's own
/// (`SYMM_BOOTSTRAP_PORT`, `SYMM_BOOTSTRAP_SECRET`), as the env bootstrap
/// looks them up.
pub fn launcher_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The variables of the library's own tests.
#[cfg(test)]
pub mod tests_env {
    pub const TEST_WORLD: &str = "SYMM_TEST_WORLD";
    pub const SM90_SHAPE: &str = "SYMM_SM90_SHAPE";
    pub const FD_LEAK_CHILD: &str = "SYMM_FD_LEAK_CHILD";

    /// `SYMM_TEST_WORLD`: the GPU tests' ranks, one per GPU (at least 2;
    /// default 2).
    pub fn test_world() -> usize {
        super::var(TEST_WORLD).and_then(|v| v.trim().parse().ok()).filter(|&w| w >= 2).unwrap_or(2)
    }

    /// `SYMM_SM90_SHAPE=MxKxN`: the one shape the sm90 timings run (for
    /// profilers); unset, every shape.
    pub fn sm90_shape() -> Option<String> {
        super::var(SM90_SHAPE)
    }

    /// `SYMM_FD_LEAK_CHILD`: set in the child process the fd-leak test
    /// runs itself in.
    pub fn fd_leak_child() -> bool {
        super::var(FD_LEAK_CHILD).is_some()
    }
}
