//! Reading the caller's arguments: NULL checks, out-parameters written only
//! on success, and option structs read up to the size the caller compiled.

use super::types::*;
use crate::array::{Array, DType};
use crate::backend::BackendChoice;
use crate::error::{err, Result};
use crate::group::GroupConfig;
use crate::ops::ReduceOp;
use std::fmt::Display;
use std::time::Duration;

/// Checks an out-pointer is non-NULL before any work is done.
pub fn out_ptr<T>(p: *mut T, name: &str) -> Result<*mut T> {
    if p.is_null() {
        Err(err!(InvalidArgument, "{name} is NULL"))
    } else {
        Ok(p)
    }
}

/// Writes a result to a checked out-pointer.
pub fn write<T>(p: *mut T, v: T) {
    // SAFETY: `p` passed `out_ptr` and the caller promises it points to a T.
    unsafe { p.write(v) }
}

/// The largest `struct_size` symm accepts (the header's preamble states
/// it). Its structs are far smaller and grow by a few fields a version;
/// a larger value is garbage (an uninitialized struct), and honouring it
/// would read or zero memory far past the caller's struct.
pub(crate) const MAX_STRUCT_SIZE: usize = 1 << 16;

/// Refuses a `struct_size` past [`MAX_STRUCT_SIZE`]; `how` says what to
/// set it to.
pub(super) fn at_most_max(size: usize, name: &str, how: &dyn Display) -> Result<usize> {
    if size > MAX_STRUCT_SIZE {
        return Err(err!(
            InvalidArgument,
            "{name}->struct_size is {size}; expected at most {MAX_STRUCT_SIZE} (is the struct uninitialized? {how})"
        ));
    }
    Ok(size)
}

/// The `struct_size` the caller set in an output struct (`out` passed
/// `out_ptr`): at least this version's size, since all of it is written,
/// and at most [`MAX_STRUCT_SIZE`].
pub fn out_struct_size<T>(out: *mut T, name: &str, how: &str) -> Result<usize> {
    // SAFETY: non-NULL; `struct_size` is the first field of every version.
    let size = unsafe { std::ptr::read(out as *const usize) };
    if size < std::mem::size_of::<T>() {
        return Err(err!(InvalidArgument, "{name}->struct_size is {size}; {how}"));
    }
    at_most_max(size, name, &how)
}

/// Borrows an input the caller passed by pointer.
pub fn in_ref<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: non-NULL, and the caller promises it points to a valid T for the call.
    unsafe { p.as_ref() }.ok_or_else(|| err!(InvalidArgument, "{name} is NULL"))
}

pub fn non_negative(v: i32, name: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| err!(InvalidArgument, "{name} is {v}; it must not be negative"))
}

pub fn backend_choice(b: symm_backend_t) -> Result<Option<BackendChoice>> {
    match b {
        SYMM_BACKEND_AUTO => Ok(None),
        SYMM_BACKEND_CUDA => Ok(Some(BackendChoice::Cuda)),
        SYMM_BACKEND_HOST => Ok(Some(BackendChoice::Host)),
        other => Err(err!(InvalidArgument, "backend {other} is not one of SYMM_BACKEND_AUTO/CUDA/HOST")),
    }
}

/// Reads a group config (NULL = defaults), honouring `struct_size` so that
/// callers compiled against an older, shorter struct keep working.
pub fn group_config(p: *const symm_group_config_t) -> Result<GroupConfig> {
    let mut cfg = GroupConfig::default();
    if p.is_null() {
        return Ok(cfg);
    }
    // SAFETY: `struct_size` is the first field of every version of the struct.
    let size = unsafe { std::ptr::read(p as *const usize) };
    let first = std::mem::offset_of!(symm_group_config_t, flags) + std::mem::size_of::<u32>();
    if size < first {
        return Err(err!(
            InvalidArgument,
            "config->struct_size is {size}; initialize the config with SYMM_GROUP_CONFIG_INIT"
        ));
    }
    at_most_max(size, "config", &"initialize it with SYMM_GROUP_CONFIG_INIT")?;
    // SAFETY: the caller's struct is at least as large as every field we read.
    let c = unsafe { &*p };
    cfg.backend = backend_choice(c.backend)?;
    cfg.timeout = match c.timeout_ms {
        0 => None,
        ms if ms > 0 => Some(Duration::from_millis(ms as u64)),
        ms => {
            return Err(err!(InvalidArgument, "config->timeout_ms is {ms}; use 0 for the default or a positive value"))
        }
    };
    let known = SYMM_GROUP_ALLOW_SHARED_DEVICE | SYMM_GROUP_CHECK_ARGS_ALWAYS;
    if c.flags & !known != 0 {
        return Err(err!(InvalidArgument, "config->flags has unknown bits {:#x}", c.flags & !known));
    }
    cfg.allow_shared_device = c.flags & SYMM_GROUP_ALLOW_SHARED_DEVICE != 0;
    cfg.check_args_always = c.flags & SYMM_GROUP_CHECK_ARGS_ALWAYS != 0;
    Ok(cfg)
}

pub fn dtype(d: symm_dtype_t, name: &str) -> Result<DType> {
    dtype_named(d, &name)
}

/// As [`dtype`], the name formatted only for the error: every call reads
/// its descriptors here, and at small sizes the host's time is the call's.
fn dtype_named(d: symm_dtype_t, name: &dyn Display) -> Result<DType> {
    match d {
        SYMM_DTYPE_F32 => Ok(DType::F32),
        SYMM_DTYPE_BF16 => Ok(DType::BF16),
        SYMM_DTYPE_F16 => Ok(DType::F16),
        SYMM_DTYPE_FP8_E4M3 => Ok(DType::F8E4M3),
        SYMM_DTYPE_FP8_E5M2 => Ok(DType::F8E5M2),
        SYMM_DTYPE_INT8 => Ok(DType::I8),
        SYMM_DTYPE_UINT8 => Ok(DType::U8),
        SYMM_DTYPE_INT32 => Ok(DType::I32),
        SYMM_DTYPE_INT64 => Ok(DType::I64),
        other => Err(err!(InvalidArgument, "{name} is {other}; expected one of the SYMM_DTYPE_* values")),
    }
}

pub fn reduce_op(op: symm_reduce_op_t) -> Result<ReduceOp> {
    match op {
        SYMM_REDUCE_SUM => Ok(ReduceOp::Sum),
        SYMM_REDUCE_AVG => Ok(ReduceOp::Avg),
        other => Err(err!(InvalidArgument, "op is {other}; expected SYMM_REDUCE_SUM or SYMM_REDUCE_AVG")),
    }
}

/// Reads a tensor descriptor, checking what the descriptor alone can show:
/// dimensions, sizes, strides, type, and a non-NULL, aligned data pointer
/// whose extent fits in the address space. The memory itself is the
/// caller's promise.
pub fn tensor(t: &symm_tensor_t, name: &dyn Display) -> Result<Array> {
    let ndim = usize::try_from(t.ndim)
        .ok()
        .filter(|n| (1..=SYMM_MAX_DIMS).contains(n))
        .ok_or_else(|| err!(InvalidArgument, "{name}.ndim is {}; expected 1 to {SYMM_MAX_DIMS}", t.ndim))?;
    let dtype = dtype_named(t.dtype, &format_args!("{name}.dtype"))?;
    let mut shape = Vec::with_capacity(ndim);
    let mut strides = Vec::with_capacity(ndim);
    for i in 0..ndim {
        let n = usize::try_from(t.shape[i]).ok().filter(|&n| n >= 1).ok_or_else(|| {
            err!(
                InvalidArgument,
                "{name}.shape[{i}] is {}; expected at least 1 (empty tensors are not supported)",
                t.shape[i]
            )
        })?;
        let s = usize::try_from(t.strides[i])
            .map_err(|_| err!(InvalidArgument, "{name}.strides[{i}] is {}; expected at least 0", t.strides[i]))?;
        shape.push(n);
        strides.push(s);
    }
    if t.data.is_null() {
        return Err(err!(InvalidArgument, "{name}.data is NULL"));
    }
    let addr = t.data as u64;
    if addr % dtype.size() as u64 != 0 {
        return Err(err!(
            InvalidArgument,
            "{name}.data is {addr:#x}; expected a multiple of the {dtype} size ({})",
            dtype.size()
        ));
    }
    let a = Array { addr, dtype, shape, strides };
    if a.extent_bytes().is_none() || a.shape.iter().try_fold(1usize, |acc, &n| acc.checked_mul(n)).is_none() {
        return Err(err!(
            InvalidArgument,
            "{name} (shape {:?}, strides {:?}) is larger than the address space allows (an object spans at most isize::MAX bytes)",
            a.shape,
            a.strides
        ));
    }
    Ok(a)
}

/// Reads the tensor descriptor `p` points to.
pub fn tensor_arg(p: *const symm_tensor_t, name: &str) -> Result<Array> {
    tensor(in_ref(p, name)?, &name)
}

/// As [`tensor_arg`], with NULL meaning "not wanted".
pub fn optional_tensor(p: *const symm_tensor_t, name: &str) -> Result<Option<Array>> {
    if p.is_null() {
        Ok(None)
    } else {
        tensor_arg(p, name).map(Some)
    }
}

/// Reads `n` tensor descriptors from an array of them.
pub fn tensors(p: *const symm_tensor_t, n: usize, name: &str) -> Result<Vec<Array>> {
    in_ref(p, name)?;
    // SAFETY: non-NULL, and the caller promises `n` descriptors.
    let ts = unsafe { std::slice::from_raw_parts(p, n) };
    ts.iter().enumerate().map(|(i, t)| tensor(t, &format_args!("{name}[{i}]"))).collect()
}

/// As [`tensors`], with NULL meaning "not given".
pub fn optional_tensors(p: *const symm_tensor_t, n: usize, name: &str) -> Result<Option<Vec<Array>>> {
    if p.is_null() {
        Ok(None)
    } else {
        tensors(p, n, name).map(Some)
    }
}

/// As [`optional_tensors`], where an entry whose `data` is NULL is absent
/// (torch's `Tensor?[]`).
pub fn optional_entries(p: *const symm_tensor_t, n: usize, name: &str) -> Result<Option<Vec<Option<Array>>>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL, and the caller promises `n` descriptors.
    let ts = unsafe { std::slice::from_raw_parts(p, n) };
    let read = |(i, t): (usize, &symm_tensor_t)| match t.data.is_null() {
        true => Ok(None),
        false => tensor(t, &format_args!("{name}[{i}]")).map(Some),
    };
    ts.iter().enumerate().map(read).collect::<Result<_>>().map(Some)
}

/// Reads an option struct (NULL: `defaults`), honouring `struct_size`:
/// it must cover at least the first `min_size` bytes (the fields of the
/// oldest version), and at most [`MAX_STRUCT_SIZE`]; fields an older
/// caller's struct ends before keep their value in `defaults`; whatever a
/// newer caller added beyond this version's fields must be zero, since
/// this version cannot honour it.
pub fn options<T: Copy>(p: *const T, name: &str, init: &str, min_size: usize, defaults: T) -> Result<T> {
    if p.is_null() {
        return Ok(defaults);
    }
    // SAFETY: `struct_size` is the first field of every option struct.
    let size = unsafe { std::ptr::read(p as *const usize) };
    let ours = std::mem::size_of::<T>();
    if size < min_size {
        return Err(err!(
            InvalidArgument,
            "{name}->struct_size is {size}; expected at least {min_size} (initialize it with {init})"
        ));
    }
    at_most_max(size, name, &format_args!("initialize it with {init}"))?;
    // Every version's size is a multiple of the struct's alignment (its
    // fields are naturally aligned and at most that wide), so an older
    // size that is not ends inside a field: half a pointer copied over a
    // NULL default would be followed.
    if size < ours && size != min_size && size % std::mem::align_of::<T>() != 0 {
        return Err(err!(
            InvalidArgument,
            "{name}->struct_size is {size}, which ends inside a field of {name} (initialize it with {init})"
        ));
    }
    if size > ours {
        // SAFETY: the caller's struct holds `size` readable bytes.
        let tail = unsafe { std::slice::from_raw_parts((p as *const u8).add(ours), size - ours) };
        if tail.iter().any(|&b| b != 0) {
            return Err(err!(
                Unsupported,
                "{name} sets fields that this version of symm ({ours}-byte {name}) does not know"
            ));
        }
    }
    let mut out = defaults;
    // SAFETY: the caller's struct holds at least min(size, ours) readable
    // bytes, a prefix of T's fields (fields are only ever appended), and T
    // is plain data.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, &mut out as *mut T as *mut u8, size.min(ours)) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(shape: &[i64], strides: &[i64]) -> symm_tensor_t {
        let mut t = symm_tensor_t {
            data: 0x10000 as *mut std::ffi::c_void,
            dtype: SYMM_DTYPE_BF16,
            ndim: shape.len() as i32,
            shape: [0; SYMM_MAX_DIMS],
            strides: [0; SYMM_MAX_DIMS],
        };
        t.shape[..shape.len()].copy_from_slice(shape);
        t.strides[..strides.len()].copy_from_slice(strides);
        t
    }

    /// Extents past what one object can span are invalid, also between
    /// 2^63 and 2^64 bytes, where a u64 still holds them.
    #[test]
    fn oversized_extents_are_invalid() {
        for stride in [1i64 << 62, i64::MAX / 2, i64::MAX] {
            let e = tensor(&desc(&[2, 8], &[stride, 1]), &"a").unwrap_err();
            assert_eq!(e.kind, crate::error::ErrorKind::InvalidArgument);
            assert!(e.msg.contains("larger than the address space"), "{}", e.msg);
        }
        assert!(tensor(&desc(&[2, 8], &[1 << 40, 1]), &"a").is_ok());
    }

    /// A `struct_size` past MAX_STRUCT_SIZE (an uninitialized struct) is
    /// refused before anything past the struct is read or written; up to
    /// it, a newer caller's zeroed tail is accepted.
    #[test]
    fn struct_size_has_an_upper_bound() {
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq)]
        struct Opts {
            struct_size: usize,
            x: u64,
        }
        let none = Opts { struct_size: 0, x: 7 };
        for size in [MAX_STRUCT_SIZE + 1, 1 << 40, usize::MAX] {
            let mut o = Opts { struct_size: size, x: 1 };
            let e = options(&o, "opts", "OPTS_INIT", 8, none).unwrap_err();
            assert_eq!(e.kind, crate::error::ErrorKind::InvalidArgument);
            let hint = "(is the struct uninitialized? initialize it with OPTS_INIT)";
            assert_eq!(e.msg, format!("opts->struct_size is {size}; expected at most 65536 {hint}"));
            let e = out_struct_size(&mut o, "info", "set it to sizeof(info)").unwrap_err();
            assert!(
                e.msg.contains("expected at most 65536") && e.msg.ends_with("set it to sizeof(info))"),
                "{}",
                e.msg
            );
        }
        // The largest accepted: a newer caller's struct of MAX_STRUCT_SIZE bytes.
        let mut newer = vec![0u64; MAX_STRUCT_SIZE / 8];
        newer[..2].copy_from_slice(&[MAX_STRUCT_SIZE as u64, 5]);
        let o = newer.as_mut_ptr().cast::<Opts>();
        assert_eq!(options(o, "opts", "OPTS_INIT", 8, none).unwrap(), Opts { struct_size: MAX_STRUCT_SIZE, x: 5 });
        assert_eq!(out_struct_size(o, "info", "").unwrap(), MAX_STRUCT_SIZE);
    }

    /// An older caller's size is honoured field by field; one that ends
    /// inside a field (half of a pointer) is refused, not half-copied.
    #[test]
    fn struct_size_within_a_field_is_refused() {
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq)]
        struct Opts {
            struct_size: usize,
            x: i32,
            p: *const u8,
        }
        let none = Opts { struct_size: 0, x: 7, p: std::ptr::null() };
        let given = |size| Opts { struct_size: size, x: 1, p: 0x1000 as *const u8 };
        // The oldest version ends after `x` (12), the next after `p` (24).
        assert_eq!(
            options(&given(12), "opts", "OPTS_INIT", 12, none).unwrap(),
            Opts { p: std::ptr::null(), ..given(12) }
        );
        assert_eq!(
            options(&given(16), "opts", "OPTS_INIT", 12, none).unwrap(),
            Opts { p: std::ptr::null(), ..given(16) }
        );
        assert_eq!(options(&given(24), "opts", "OPTS_INIT", 12, none).unwrap(), given(24));
        for size in [13, 17, 20, 23] {
            let e = options(&given(size), "opts", "OPTS_INIT", 12, none).unwrap_err();
            assert_eq!(e.kind, crate::error::ErrorKind::InvalidArgument);
            assert!(e.msg.contains(&format!("struct_size is {size}, which ends inside a field")), "{}", e.msg);
        }
    }
}
