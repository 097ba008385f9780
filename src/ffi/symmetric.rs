//! Which arguments of an operation symm uses in place when they lie in
//! symmetric memory, so a framework that chooses where buffers live (a
//! compiler's allocator) can place those in a rendezvoused buffer.

use super::args::{out_ptr, out_struct_size};
use super::boundary::call;
use super::types::symm_status_t;
use crate::error::{err, Result};
use crate::ops::{symmetric_args, PeerAccess, SYMMETRIC_ARGS};
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::sync::OnceLock;

/// Capacity of `symm_symmetric_args_t`'s arrays.
pub const SYMM_MAX_SYMMETRIC_ARGS: usize = 8;

/// Access flag: the peers read this rank's tensor where it lies (no copy
/// into the workspace first).
pub const SYMM_PEERS_READ: u32 = 1;
/// Access flag: the peers may write into this rank's tensor where it lies.
pub const SYMM_PEERS_WRITE: u32 = 2;

/// The arguments one operation uses in place from symmetric memory. Set
/// `struct_size` to `sizeof(symm_symmetric_args_t)` (`SYMM_SYMMETRIC_ARGS_INIT`);
/// fields are only ever appended, and those this library does not know are
/// zeroed.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct symm_symmetric_args_t {
    /// `sizeof(symm_symmetric_args_t)` as the caller compiled it.
    pub struct_size: usize,
    /// How many of `names` and `access` are set (0: none is used in place).
    pub count: i32,
    /// The parameters' names as in this header (`"input"`, `"out"`); static.
    pub names: [*const c_char; SYMM_MAX_SYMMETRIC_ARGS],
    /// `SYMM_PEERS_*` flags of each name.
    pub access: [u32; SYMM_MAX_SYMMETRIC_ARGS],
}

/// Which arguments of `operation` (a function's name without `symm_`:
/// "fused_ag_mm", "mm_rs", "lc_allgather", "all_reduce" or
/// "all_reduce_rmsnorm") symm uses where they are when the tensor is
/// contiguous in a rendezvoused symmetric buffer at the same offset on
/// every rank. Elsewhere such an argument is staged through the group's
/// workspace (a copy); the result is the same either way. Fills `args`,
/// whose `struct_size` the caller set. Needs no group: the answer is this
/// library's, the same for every group and backend.
#[no_mangle]
pub unsafe extern "C" fn symm_op_symmetric_args(
    operation: *const c_char,
    args: *mut symm_symmetric_args_t,
) -> symm_status_t {
    call("symm_op_symmetric_args", || {
        let out = out_ptr(args, "args")?;
        let ours = std::mem::size_of::<symm_symmetric_args_t>();
        let size = out_struct_size(out, "args", &format!("set it to sizeof(symm_symmetric_args_t) ({ours})"))?;
        let filled = query(operation, size)?;
        // SAFETY: the caller's struct holds `size` >= `ours` writable bytes;
        // a newer caller's fields beyond ours read as zero (unknown).
        unsafe {
            out.write(filled);
            std::ptr::write_bytes((out as *mut u8).add(ours), 0, size - ours);
        }
        Ok(())
    })
}

/// `name` as a static C string (the table's names, made once).
fn c_name(name: &'static str) -> *const c_char {
    static NAMES: OnceLock<HashMap<&'static str, CString>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        let all = SYMMETRIC_ARGS.iter().flat_map(|(_, args)| args.iter().map(|a| a.name));
        all.map(|n| (n, CString::new(n).expect("argument names have no NUL"))).collect()
    });
    names[name].as_ptr()
}

fn query(operation: *const c_char, struct_size: usize) -> Result<symm_symmetric_args_t> {
    if operation.is_null() {
        return Err(err!(InvalidArgument, "operation is NULL"));
    }
    // SAFETY: non-NULL; the caller promises a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(operation) }.to_str().unwrap_or("");
    let found = symmetric_args(name).ok_or_else(|| {
        let known: Vec<&str> = SYMMETRIC_ARGS.iter().map(|(op, _)| *op).collect();
        err!(InvalidArgument, "operation {:?} is not one of {}", name, known.join(", "))
    })?;
    if found.len() > SYMM_MAX_SYMMETRIC_ARGS {
        return Err(err!(Internal, "{name} has {} symmetric arguments, more than the struct holds", found.len()));
    }
    let mut out = symm_symmetric_args_t {
        struct_size,
        count: found.len() as i32,
        names: [std::ptr::null(); SYMM_MAX_SYMMETRIC_ARGS],
        access: [0; SYMM_MAX_SYMMETRIC_ARGS],
    };
    for (i, a) in found.iter().enumerate() {
        out.names[i] = c_name(a.name);
        out.access[i] = match a.access {
            PeerAccess::Read => SYMM_PEERS_READ,
            PeerAccess::Write => SYMM_PEERS_WRITE,
        };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(op: &CStr, struct_size: usize) -> (symm_status_t, symm_symmetric_args_t) {
        let mut a = symm_symmetric_args_t {
            struct_size,
            count: -1,
            names: [std::ptr::null(); SYMM_MAX_SYMMETRIC_ARGS],
            access: [0; SYMM_MAX_SYMMETRIC_ARGS],
        };
        let st = unsafe { symm_op_symmetric_args(op.as_ptr(), &mut a) };
        (st, a)
    }

    fn names(a: &symm_symmetric_args_t) -> Vec<(String, u32)> {
        (0..a.count as usize)
            .map(|i| (unsafe { CStr::from_ptr(a.names[i]) }.to_str().unwrap().to_string(), a.access[i]))
            .collect()
    }

    #[test]
    fn answers_per_operation() {
        let size = std::mem::size_of::<symm_symmetric_args_t>();
        let want: [(&CStr, &[(&str, u32)]); 5] = [
            (c"fused_ag_mm", &[("a_shard", SYMM_PEERS_READ)]),
            (c"mm_rs", &[("out", SYMM_PEERS_WRITE)]),
            (c"lc_allgather", &[("input", SYMM_PEERS_READ)]),
            (c"all_reduce", &[("input", SYMM_PEERS_READ)]),
            (c"all_reduce_rmsnorm", &[("input", SYMM_PEERS_READ)]),
        ];
        for (op, expected) in want {
            let (st, a) = ask(op, size);
            assert_eq!(st, super::super::types::SYMM_SUCCESS, "{op:?}");
            let expected: Vec<(String, u32)> = expected.iter().map(|(n, f)| (n.to_string(), *f)).collect();
            assert_eq!(names(&a), expected, "{op:?}");
            assert!(a.names[a.count as usize..].iter().all(|p| p.is_null()));
        }
    }

    #[test]
    fn bad_calls_write_nothing() {
        use super::super::types::SYMM_ERROR_INVALID_ARGUMENT;
        let size = std::mem::size_of::<symm_symmetric_args_t>();
        for (op, struct_size) in [(c"symm_all_reduce", size), (c"", size), (c"mm_rs", size - 1), (c"mm_rs", 0)] {
            let (st, a) = ask(op, struct_size);
            assert_eq!(st, SYMM_ERROR_INVALID_ARGUMENT, "{op:?} {struct_size}");
            assert_eq!(a.count, -1, "untouched");
        }
        let mut a = ask(c"mm_rs", size).1;
        assert_eq!(unsafe { symm_op_symmetric_args(std::ptr::null(), &mut a) }, SYMM_ERROR_INVALID_ARGUMENT);
        assert_eq!(
            unsafe { symm_op_symmetric_args(c"mm_rs".as_ptr(), std::ptr::null_mut()) },
            SYMM_ERROR_INVALID_ARGUMENT
        );
    }

    /// Each name is a parameter of the operation's function in the header,
    /// and fits the struct.
    #[test]
    fn names_are_the_header_parameters() {
        let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/symm.h")).unwrap();
        for (op, args) in SYMMETRIC_ARGS {
            assert!(args.len() <= SYMM_MAX_SYMMETRIC_ARGS);
            let decl = format!("symm_status_t symm_{op}(");
            let start = header.find(&decl).unwrap_or_else(|| panic!("{decl} not in the header"));
            let params = &header[start..start + header[start..].find(')').unwrap()];
            for a in *args {
                assert!(params.contains(&format!("*{},", a.name)), "{op} has no parameter {}: {params}", a.name);
            }
        }
    }

    /// A newer caller's larger struct: the fields past ours read zero.
    #[test]
    fn larger_struct_is_zero_past_ours() {
        let ours = std::mem::size_of::<symm_symmetric_args_t>();
        let mut bytes = vec![0xffu8; ours + 16];
        bytes[..8].copy_from_slice(&(ours + 16).to_ne_bytes());
        let p = bytes.as_mut_ptr().cast::<symm_symmetric_args_t>();
        assert_eq!(unsafe { symm_op_symmetric_args(c"lc_allgather".as_ptr(), p) }, 0);
        assert!(bytes[ours..].iter().all(|&b| b == 0));
        assert_eq!(unsafe { (*p).count }, 1);
    }
}
