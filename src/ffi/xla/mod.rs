//! XLA FFI handlers, so that JAX (or any XLA program) calls the operations
//! as custom calls inside compiled programs. Written against XLA FFI's C
//! API (`xla/ffi/api/c_api.h`), whose bindings in `c_api.rs` are generated
//! by `scripts/gen-xla-ffi.sh` and committed.
//!
//! The handlers are exported by name (`symm_xla_<op>_<platform>`) and
//! registered by `symm.jax`; their signature is XLA's, not part of
//! `include/symm.h`. What is in the header is how a device finds its group:
//! `symm_xla_bind_device` (see `registry`).

#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code, clippy::all)]
mod c_api;

mod api;
// XLA's constant names (`XLA_FFI_DataType_F32`...) appear in match patterns.
#[allow(non_upper_case_globals)]
mod frame;
#[allow(non_upper_case_globals)]
mod handlers;
pub(super) mod registry;

#[cfg(test)]
#[allow(non_upper_case_globals)]
mod tests;
