//! The handlers driven as XLA drives them, through a fake API table and
//! hand-built call frames: the metadata handshake, a collective over two
//! host-backend ranks bound to CPU devices, and the errors XLA gets back.

use super::c_api::*;
use super::handlers::{symm_xla_fused_ag_mm_cpu, symm_xla_lc_allgather_cpu};
use super::registry::{self, Platform};
use crate::backend::BackendChoice;
use crate::ffi::group::GROUPS;
use crate::ffi::types::symm_group_t;
use crate::group::{Group, GroupConfig};
use std::ffi::{c_void, CStr, CString};
use std::ptr::null_mut;
use std::time::Duration;

// --- a fake XLA: errors are boxed strings, the context is the device ordinal

unsafe extern "C" fn error_create(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error {
    let args = unsafe { &*args };
    let msg = unsafe { CStr::from_ptr(args.message) }.to_string_lossy();
    Box::into_raw(Box::new(format!("code {}: {msg}", args.errc))).cast()
}

unsafe extern "C" fn device_ordinal(args: *mut XLA_FFI_DeviceOrdinal_Get_Args) -> *mut XLA_FFI_Error {
    let args = unsafe { &mut *args };
    args.device_ordinal = unsafe { *(args.ctx as *const i32) };
    null_mut()
}

fn fake_api() -> XLA_FFI_Api {
    // SAFETY: all-zero is a valid table (NULL pointers, no functions).
    let mut api: XLA_FFI_Api = unsafe { std::mem::zeroed() };
    api.struct_size = std::mem::size_of::<XLA_FFI_Api>();
    api.api_version.major_version = XLA_FFI_API_MAJOR as i32;
    api.api_version.minor_version = XLA_FFI_API_MINOR as i32;
    api.XLA_FFI_Error_Create = Some(error_create);
    api.XLA_FFI_DeviceOrdinal_Get = Some(device_ordinal);
    api
}

/// Takes the fake error a handler returned (None for success).
fn message(e: *mut XLA_FFI_Error) -> Option<String> {
    (!e.is_null()).then(|| *unsafe { Box::from_raw(e.cast::<String>()) })
}

/// Buffers, attributes and the frame that points at them, for one call.
struct Call {
    dims: Vec<Vec<i64>>,
    bufs: Vec<XLA_FFI_Buffer>,
    n_args: usize,
    attr_names: Vec<CString>,
    attr_values: Vec<i64>,
    /// The `groups` array attribute, when given.
    groups: Option<Vec<i64>>,
}

impl Call {
    fn new(args: &[(&mut [f32], &[i64])], rets: &[(&mut [f32], &[i64])], attrs: &[(&str, i64)]) -> Call {
        let dims: Vec<Vec<i64>> = args.iter().chain(rets).map(|(_, d)| d.to_vec()).collect();
        let bufs = args
            .iter()
            .chain(rets)
            .zip(&dims)
            .map(|((data, _), d)| XLA_FFI_Buffer {
                struct_size: XLA_FFI_Buffer_STRUCT_SIZE as usize,
                extension_start: null_mut(),
                dtype: XLA_FFI_DataType_F32,
                data: data.as_ptr() as *mut c_void,
                rank: d.len() as i64,
                dims: d.as_ptr() as *mut i64,
            })
            .collect();
        Call {
            dims,
            bufs,
            n_args: args.len(),
            attr_names: attrs.iter().map(|(n, _)| CString::new(*n).unwrap()).collect(),
            attr_values: attrs.iter().map(|(_, v)| *v).collect(),
            groups: None,
        }
    }

    /// The call with the `groups` attribute (the handles its program was traced for).
    fn traced_for(mut self, handles: &[i64]) -> Call {
        self.groups = Some(handles.to_vec());
        self
    }

    /// Runs `handler` with this call on device `ordinal`.
    fn run(&mut self, handler: XLA_FFI_Handler, ordinal: i32, stage: XLA_FFI_ExecutionStage) -> Option<String> {
        let _ = &self.dims; // the buffers point into it
        let api = fake_api();
        let mut ctx = ordinal;
        let mut ptrs: Vec<*mut c_void> = self.bufs.iter_mut().map(|b| (b as *mut XLA_FFI_Buffer).cast()).collect();
        let (arg_ptrs, ret_ptrs) = ptrs.split_at_mut(self.n_args);
        let mut arg_types = vec![XLA_FFI_ArgType_BUFFER; arg_ptrs.len()];
        let mut ret_types = vec![XLA_FFI_RetType_BUFFER; ret_ptrs.len()];
        let mut spans: Vec<XLA_FFI_ByteSpan> =
            self.attr_names.iter().map(|n| XLA_FFI_ByteSpan { ptr: n.as_ptr(), len: n.as_bytes().len() }).collect();
        let mut span_ptrs: Vec<*mut XLA_FFI_ByteSpan> = spans.iter_mut().map(|s| s as *mut _).collect();
        let mut scalars: Vec<XLA_FFI_Scalar> = self
            .attr_values
            .iter_mut()
            .map(|v| XLA_FFI_Scalar { dtype: XLA_FFI_DataType_S64, value: (v as *mut i64).cast() })
            .collect();
        let mut attr_ptrs: Vec<*mut c_void> = scalars.iter_mut().map(|s| (s as *mut XLA_FFI_Scalar).cast()).collect();
        let mut attr_types = vec![XLA_FFI_AttrType_SCALAR; attr_ptrs.len()];
        let mut groups_name = XLA_FFI_ByteSpan { ptr: c"groups".as_ptr(), len: 6 };
        let mut groups = self.groups.as_mut().map(|g| XLA_FFI_Array {
            dtype: XLA_FFI_DataType_S64,
            size: g.len(),
            data: g.as_mut_ptr().cast(),
        });
        if let Some(g) = groups.as_mut() {
            span_ptrs.push(&mut groups_name);
            attr_ptrs.push((g as *mut XLA_FFI_Array).cast());
            attr_types.push(XLA_FFI_AttrType_ARRAY);
        }
        let mut frame = XLA_FFI_CallFrame {
            struct_size: XLA_FFI_CallFrame_STRUCT_SIZE as usize,
            extension_start: null_mut(),
            api: &api,
            ctx: (&mut ctx as *mut i32).cast(),
            stage,
            args: XLA_FFI_Args {
                struct_size: XLA_FFI_Args_STRUCT_SIZE as usize,
                extension_start: null_mut(),
                size: arg_ptrs.len() as i64,
                types: arg_types.as_mut_ptr(),
                args: arg_ptrs.as_mut_ptr(),
            },
            rets: XLA_FFI_Rets {
                struct_size: XLA_FFI_Rets_STRUCT_SIZE as usize,
                extension_start: null_mut(),
                size: ret_ptrs.len() as i64,
                types: ret_types.as_mut_ptr(),
                rets: ret_ptrs.as_mut_ptr(),
            },
            attrs: XLA_FFI_Attrs {
                struct_size: XLA_FFI_Attrs_STRUCT_SIZE as usize,
                extension_start: null_mut(),
                size: attr_ptrs.len() as i64,
                types: attr_types.as_mut_ptr(),
                names: span_ptrs.as_mut_ptr(),
                attrs: attr_ptrs.as_mut_ptr(),
            },
            future: null_mut(),
        };
        message(unsafe { handler.unwrap()(&mut frame) })
    }
}

/// Two host ranks bound to CPU devices `first` and `first + 1` (ordinals
/// no other test uses: the registry is global).
fn bound_pair(first: i32) -> Vec<symm_group_t> {
    let cfg = GroupConfig {
        backend: Some(BackendChoice::Host),
        timeout: Some(Duration::from_secs(10)),
        ..Default::default()
    };
    let groups = Group::new_local(&[0, 0], &cfg).unwrap();
    groups
        .into_iter()
        .enumerate()
        .map(|(r, g)| {
            let h = GROUPS.insert(g) as symm_group_t;
            registry::bind(Platform::Cpu, first + r as i32, h).unwrap();
            h
        })
        .collect()
}

#[test]
fn metadata_handshake_reports_version_and_no_traits() {
    let api = fake_api();
    let mut md: XLA_FFI_Metadata = unsafe { std::mem::zeroed() };
    md.struct_size = std::mem::size_of::<XLA_FFI_Metadata>();
    md.traits = 0xff;
    let mut ext = XLA_FFI_Metadata_Extension {
        extension_base: XLA_FFI_Extension_Base {
            struct_size: XLA_FFI_Metadata_Extension_STRUCT_SIZE as usize,
            type_: XLA_FFI_Extension_Metadata,
            next: null_mut(),
        },
        metadata: &mut md,
    };
    let mut frame: XLA_FFI_CallFrame = unsafe { std::mem::zeroed() };
    frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE as usize;
    frame.api = &api;
    frame.extension_start = (&mut ext as *mut XLA_FFI_Metadata_Extension).cast();
    assert_eq!(message(unsafe { symm_xla_lc_allgather_cpu(&mut frame) }), None);
    assert_eq!((md.api_version.major_version, md.api_version.minor_version), (0, XLA_FFI_API_MINOR as i32));
    assert_eq!(md.traits, 0, "replays of a recorded call are not safe: no command-buffer trait");

    // A frame smaller than ours is refused with a message.
    frame.extension_start = null_mut();
    frame.struct_size = 8 * std::mem::size_of::<usize>();
    let e = message(unsafe { symm_xla_lc_allgather_cpu(&mut frame) }).unwrap();
    assert!(e.contains("XLA_FFI_CallFrame is 64 bytes"), "{e}");
    assert!(message(unsafe { symm_xla_lc_allgather_cpu(null_mut()) }).is_none(), "nothing to report to");
}

#[test]
fn ranks_follow_devices_through_a_collective() {
    let handles = bound_pair(1000);
    let results: Vec<(Option<String>, Vec<f32>)> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let mut input: Vec<f32> = (0..6).map(|i| (10 * r + i) as f32 + 0.5).collect();
                    let mut output = vec![f32::NAN; 12];
                    let e = Call::new(&[(&mut input, &[2, 3])], &[(&mut output, &[4, 3])], &[]).run(
                        Some(symm_xla_lc_allgather_cpu),
                        1000 + r,
                        XLA_FFI_ExecutionStage_EXECUTE,
                    );
                    (e, output)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..6).map(|i| i as f32 + 0.5).chain((0..6).map(|i| (10 + i) as f32 + 0.5)).collect();
    for (e, out) in results {
        assert_eq!(e, None);
        assert_eq!(out, want);
    }
    for (r, h) in handles.into_iter().enumerate() {
        registry::bind(Platform::Cpu, 1000 + r as i32, null_mut()).unwrap();
        GROUPS.remove(h as usize).unwrap();
    }
}

#[test]
fn a_call_one_device_cannot_read_fails_on_every_device() {
    let handles = bound_pair(2000);
    let errors: Vec<String> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let (mut a, mut b, mut out) = (vec![1.0f32; 8], vec![1.0f32; 8], vec![0.0f32; 8]);
                    // Device 2001 misspells the attribute.
                    let name = if r == 0 { "gather_dim" } else { "gather_dimm" };
                    Call::new(&[(&mut a, &[2, 4]), (&mut b, &[4, 2])], &[(&mut out, &[4, 2])], &[(name, 0)])
                        .run(Some(symm_xla_fused_ag_mm_cpu), 2000 + r, XLA_FFI_ExecutionStage_EXECUTE)
                        .unwrap()
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert!(
        errors[1].starts_with(&format!(
            "code {XLA_FFI_Error_Code_INVALID_ARGUMENT}: symm_fused_ag_mm: cpu device 2001, rank 1 of 2:"
        )),
        "{}",
        errors[1]
    );
    assert!(errors[1].contains("attribute gather_dim is missing"), "{}", errors[1]);
    assert!(errors[0].starts_with(&format!("code {XLA_FFI_Error_Code_ABORTED}:")), "{}", errors[0]);
    assert!(errors[0].contains("rank 1: ") && errors[0].contains("gather_dim is missing"), "{}", errors[0]);

    // Another stage than execute, and a device bound to no group.
    let (mut x, mut y) = (vec![0f32; 2], vec![0f32; 4]);
    let mut call = Call::new(&[(&mut x, &[2])], &[(&mut y, &[4])], &[]);
    let e = call.run(Some(symm_xla_lc_allgather_cpu), 2000, XLA_FFI_ExecutionStage_PREPARE).unwrap();
    assert!(e.contains("execution stage 1"), "{e}");
    let e = call.run(Some(symm_xla_lc_allgather_cpu), 2999, XLA_FFI_ExecutionStage_EXECUTE).unwrap();
    assert!(e.contains("cpu device 2999 is bound to no symm group"), "{e}");

    // Destroying the group leaves the binding pointing at nothing.
    for (r, h) in handles.into_iter().enumerate() {
        GROUPS.remove(h as usize).unwrap();
        let e = call.run(Some(symm_xla_lc_allgather_cpu), 2000 + r as i32, XLA_FFI_ExecutionStage_EXECUTE).unwrap();
        assert!(e.contains("not a live symm_group_t") && e.contains("bind the device again"), "{e}");
    }
}

#[test]
fn a_program_traced_for_other_groups_is_refused_on_every_device() {
    let handles = bound_pair(3000);
    let run = |traced: Vec<i64>| -> Vec<(Option<String>, Vec<f32>)> {
        std::thread::scope(|s| {
            let joins: Vec<_> =
                (0..2)
                    .map(|r| {
                        let traced = traced.clone();
                        s.spawn(move || {
                            let mut input = vec![r as f32 + 0.5; 4];
                            let mut output = vec![f32::NAN; 8];
                            let e = Call::new(&[(&mut input, &[4])], &[(&mut output, &[8])], &[])
                                .traced_for(&traced)
                                .run(Some(symm_xla_lc_allgather_cpu), 3000 + r, XLA_FFI_ExecutionStage_EXECUTE);
                            (e, output)
                        })
                    })
                    .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        })
    };
    // Traced for the groups bound now: runs.
    for (e, out) in run(handles.iter().map(|&h| h as i64).collect()) {
        assert_eq!(e, None);
        assert_eq!(out, [0.5, 0.5, 0.5, 0.5, 1.5, 1.5, 1.5, 1.5]);
    }
    // Traced for groups since replaced (handles are never reused): refused
    // on both devices, their outputs untouched.
    let stale: Vec<i64> = handles.iter().map(|&h| h as i64 + (1 << 20)).collect();
    for (e, out) in run(stale) {
        let e = e.expect("a stale program ran");
        assert!(e.contains("traced for other symm groups"), "{e}");
        assert!(out.iter().all(|v| v.is_nan()), "{out:?}");
    }
    for (r, h) in handles.into_iter().enumerate() {
        registry::bind(Platform::Cpu, 3000 + r as i32, null_mut()).unwrap();
        GROUPS.remove(h as usize).unwrap();
    }
}
