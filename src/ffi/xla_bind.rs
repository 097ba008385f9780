//! Binding XLA devices to groups, for the XLA FFI handlers (`src/ffi/xla`).

use super::boundary::call;
use super::types::*;
use super::xla::registry::{self, Platform};
use crate::error::err;
use std::ffi::c_int;

/// Makes symm's XLA FFI handlers run as `group`'s rank when XLA calls them
/// on device `device_ordinal` of `platform` (what `XLA_FFI_DeviceOrdinal_Get`
/// reports there). A NULL `group` unbinds the device. Rebinding replaces.
///
/// The handlers, exported by this library with XLA's handler signature
/// (`XLA_FFI_Error *(XLA_FFI_CallFrame *)`), are `symm_xla_{fused_ag_mm,
/// mm_rs,lc_allgather,all_reduce,all_reduce_rmsnorm}_{cuda,cpu}`; register
/// them with XLA under the platform of their suffix. The binding refers to the
/// handle: after `symm_group_destroy`, calls on the device fail until it is
/// bound again. A call may carry an int64-array attribute `groups`, the
/// handles bound when its program was built: on a device bound to a handle
/// not among them, it fails (on every device) instead of running on a group
/// the program was not made for.
#[no_mangle]
pub extern "C" fn symm_xla_bind_device(
    platform: symm_xla_platform_t,
    device_ordinal: c_int,
    group: symm_group_t,
) -> symm_status_t {
    call("symm_xla_bind_device", || {
        let platform = match platform {
            SYMM_XLA_PLATFORM_CPU => Platform::Cpu,
            SYMM_XLA_PLATFORM_CUDA => Platform::Cuda,
            other => {
                return Err(err!(
                    InvalidArgument,
                    "platform is {other}; expected SYMM_XLA_PLATFORM_CPU or SYMM_XLA_PLATFORM_CUDA"
                ))
            }
        };
        registry::bind(platform, device_ordinal, group)
    })
}
