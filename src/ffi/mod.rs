//! The C ABI: the only place with `extern "C"` functions and raw pointers
//! from the caller. Every function here validates its arguments, maps errors
//! to `symm_status_t` with a thread-local message, and catches panics.
//! `include/symm.h` is generated from these files by cbindgen.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)] // the safety contract is the C header's documentation

mod args;
mod boundary;
mod buffer;
mod callback;
mod group;
mod handles;
mod log;
mod ops;
mod plan;
mod symmetric;
pub mod types;
mod version;
/// cbindgen:ignore
mod xla;
mod xla_bind;

pub use boundary::status_of;
