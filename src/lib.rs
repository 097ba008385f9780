//! symm: symmetric memory and fused tensor-parallel operations for
//! multi-GPU programs, behind a stable C ABI (`include/symm.h`).
//!
//! Layers, each depending only on those below it:
//! `ffi` (the C shell) -> `ops` -> `buffer` -> `group` -> `bootstrap`,
//! `ipc`, `backend` -> `array`, `error`; beside them `config` (the
//! environment, read once) and `cost` (the cost model).

pub(crate) mod array;
pub(crate) mod backend;
#[doc(hidden)]
pub mod bench_support;
pub(crate) mod bootstrap;
pub(crate) mod error;
pub(crate) mod fp8;
pub(crate) mod ipc;
pub(crate) mod logging;
pub(crate) mod overlap;

pub(crate) mod buffer;
pub(crate) mod config;
pub(crate) mod cost;
pub mod ffi;
pub(crate) mod group;
pub(crate) mod health;
pub(crate) mod ops;
pub(crate) mod sync;
pub(crate) mod topology;
pub(crate) mod wire;
