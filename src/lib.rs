//! symm: symmetric memory and fused tensor-parallel operations for
//! multi-GPU programs, behind a stable C ABI (`include/symm.h`).
//!
//! Layers, each depending only on those below it:
//! `ffi` (the C shell) -> `ops` -> `buffer` -> `group` -> `bootstrap`,
//! `ipc`, `backend` -> `array`, `error`; beside them `config` (the
//! environment, read once) and `cost` (the cost model).

pub mod array;
pub mod backend;
#[doc(hidden)]
pub mod bench_support;
pub mod bootstrap;
pub mod error;
pub mod fp8;
pub mod ipc;
pub mod logging;

pub use error::{Error, ErrorKind, Result};
pub mod buffer;
pub mod config;
pub mod cost;
pub mod ffi;
pub mod group;
pub mod ops;
pub(crate) mod sync;
pub(crate) mod wire;
