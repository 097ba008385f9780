//! symm: symmetric memory and fused tensor-parallel operations for
//! multi-GPU programs, behind a stable C ABI (`include/symm.h`).
//!
//! Layers, each depending only on those below it:
//! `ffi` (the C shell) -> `ops` -> `group`/`buffer` -> `bootstrap`, `ipc`,
//! `backend` -> `array`, `error`.

pub mod array;
pub mod backend;
#[doc(hidden)]
pub mod bench_support;
pub mod bootstrap;
pub mod error;
pub mod fp8;
pub mod ipc;

pub use error::{Error, ErrorKind, Result};
pub mod buffer;
pub mod ffi;
pub mod group;
pub mod ops;
pub mod plan;
pub(crate) mod wire;
