//! Fuzzes the C API's argument decoding and checks: tensor descriptors,
//! option structs, dims, ops and counts, as a C caller would pass them, to
//! `symm_fused_ag_mm`, `symm_mm_rs` and `symm_lc_allgather` on a one-rank
//! host group.
//!
//! Descriptors point into one arena. A call is made only if every
//! descriptor either lies inside the arena or must be refused from the
//! descriptor alone (bad ndim or dtype, a size below 1, a negative stride,
//! an extent past `isize::MAX` bytes): anything else would break the C
//! contract (memory the caller promises exists), which no library can
//! check. For every call made:
//! - the status is a known one and never `SYMM_ERROR_INTERNAL` (a panic or
//!   a bug);
//! - a failing call has a message and leaves the arena unchanged;
//! - the group stays healthy (a one-rank group has no peer to fail).

#![no_main]
// The handles are pointers to opaque structs, only ever passed back to symm.
#![allow(improper_ctypes)]

use libfuzzer_sys::fuzz_target;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;
use symm::ffi::types::*;

extern "C" {
    fn symm_group_init_local(
        groups: *mut symm_group_t,
        n: c_int,
        devices: *const c_int,
        cfg: *const symm_group_config_t,
    ) -> symm_status_t;
    fn symm_fused_ag_mm(
        group: symm_group_t,
        a_shard: *const symm_tensor_t,
        bs: *const symm_tensor_t,
        num_b: c_int,
        gather_dim: c_int,
        ag_out: *const symm_tensor_t,
        outs: *const symm_tensor_t,
        opts: *const symm_ag_mm_options_t,
        stream: *mut c_void,
    ) -> symm_status_t;
    fn symm_mm_rs(
        group: symm_group_t,
        a: *const symm_tensor_t,
        b: *const symm_tensor_t,
        scatter_dim: c_int,
        op: symm_reduce_op_t,
        out: *const symm_tensor_t,
        opts: *const symm_mm_rs_options_t,
        stream: *mut c_void,
    ) -> symm_status_t;
    fn symm_lc_allgather(
        group: symm_group_t,
        input: *const symm_tensor_t,
        output: *const symm_tensor_t,
        stream: *mut c_void,
    ) -> symm_status_t;
    fn symm_group_health(group: symm_group_t, status: *mut symm_status_t) -> symm_status_t;
    fn symm_last_error() -> *const c_char;
}

/// Bytes of the arena every descriptor points into. Small, so that a
/// matmul that passes the checks stays cheap.
const ARENA: usize = 64 << 10;
/// Bytes after the arena that no call may touch (a write there is a write
/// outside every tensor it was given).
const GUARD: usize = 16 << 10;
const MAX_TENSORS: usize = 12;

struct Fixture {
    group: usize,
    arena: usize,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = symm_group_config_t {
            struct_size: std::mem::size_of::<symm_group_config_t>(),
            backend: SYMM_BACKEND_HOST,
            timeout_ms: 2000,
            flags: 0,
        };
        let mut g: symm_group_t = std::ptr::null_mut();
        // SAFETY: out-pointer for one group; cfg is a valid config.
        let st = unsafe { symm_group_init_local(&mut g, 1, std::ptr::null(), &cfg) };
        assert_eq!(st, SYMM_SUCCESS, "forming the fuzz group");
        let arena = Box::leak(vec![0u64; (ARENA + GUARD) / 8].into_boxed_slice());
        Fixture { group: g as usize, arena: arena.as_mut_ptr() as usize }
    })
}

/// Reads the fuzzer's bytes as values.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |v, i| v | (self.byte() as u64) << (8 * i))
    }
    /// Mostly small sizes, sometimes an extreme or any value.
    fn size(&mut self) -> i64 {
        match self.byte() % 16 {
            0 => self.u64() as i64,
            1 => 1i64 << (self.byte() % 64),
            2 => -((self.byte() % 4) as i64),
            3 => i64::MAX - (self.byte() % 4) as i64,
            k => (k as i64 - 4) + (self.byte() % 8) as i64,
        }
    }
}

/// One descriptor from the input, pointing into the arena.
fn tensor(inp: &mut Input, arena: usize) -> symm_tensor_t {
    let ndim = match inp.byte() % 16 {
        0 => inp.byte() as i8 as i32,
        k => (k % 4 + 1) as i32,
    };
    // SYMM_DTYPE_F32 (1) to SYMM_DTYPE_INT64 (9), or any value.
    let dtype = match inp.byte() % 16 {
        15 => inp.byte() as i32 - 2,
        k => (k % 9) as i32 + 1,
    };
    let mut t = symm_tensor_t { data: std::ptr::null_mut(), dtype, ndim, shape: [0; 8], strides: [0; 8] };
    let dims = (ndim.clamp(0, 8)) as usize;
    let contiguous = inp.byte() % 2 == 0;
    for d in 0..dims {
        t.shape[d] = inp.size();
    }
    if contiguous {
        let mut s = 1i64;
        for d in (0..dims).rev() {
            t.strides[d] = s;
            s = s.wrapping_mul(t.shape[d].max(1));
        }
    } else {
        for d in 0..dims {
            t.strides[d] = inp.size();
        }
    }
    t.data = match inp.byte() % 32 {
        0 => std::ptr::null_mut(),
        1 => (arena + 1) as *mut c_void, // misaligned for most dtypes
        _ => (arena + (inp.u64() as usize % ARENA) / 8 * 8) as *mut c_void,
    };
    t
}

/// Whether a call with this descriptor keeps the C contract: it lies in
/// the arena, or symm must refuse it without reading memory.
fn callable(t: &symm_tensor_t, arena: usize) -> bool {
    let size: u128 = match t.dtype {
        SYMM_DTYPE_INT64 => 8,
        SYMM_DTYPE_F32 | SYMM_DTYPE_INT32 => 4,
        SYMM_DTYPE_BF16 | SYMM_DTYPE_F16 => 2,
        SYMM_DTYPE_FP8_E4M3 | SYMM_DTYPE_FP8_E5M2 | SYMM_DTYPE_INT8 | SYMM_DTYPE_UINT8 => 1,
        _ => return true,
    };
    if !(1..=8).contains(&t.ndim) || t.data.is_null() {
        return true;
    }
    let dims = t.ndim as usize;
    if t.shape[..dims].iter().any(|&n| n < 1) || t.strides[..dims].iter().any(|&s| s < 0) {
        return true;
    }
    // Each term is below 2^126; their sum saturates past u128.
    let last = (0..dims).fold(0u128, |acc, d| acc.saturating_add((t.shape[d] as u128 - 1) * t.strides[d] as u128));
    let bytes = last.saturating_add(1).saturating_mul(size);
    if bytes > isize::MAX as u128 {
        return true;
    }
    let start = t.data as u128;
    start >= arena as u128 && start + bytes <= (arena + ARENA) as u128
}

fn known(st: symm_status_t) -> bool {
    (SYMM_SUCCESS..=SYMM_ERROR_INTERNAL).contains(&st)
}

/// An option struct in 64 zeroed bytes: a `struct_size` larger than the
/// struct reads zeros past its end, as the C API's rules allow.
fn padded<T>(o: &T) -> [u8; 64] {
    let mut bytes = [0u8; 64];
    let n = std::mem::size_of::<T>();
    assert!(n <= bytes.len());
    // SAFETY: `o` is `n` readable bytes; `bytes` has room for them.
    unsafe { std::ptr::copy_nonoverlapping(o as *const T as *const u8, bytes.as_mut_ptr(), n) };
    bytes
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let mut inp = Input(data);
    let op = inp.byte() % 3;
    let n = (inp.byte() % 3) as usize + 1;
    let mut ts: Vec<symm_tensor_t> = (0..MAX_TENSORS).map(|_| tensor(&mut inp, f.arena)).collect();
    // The scales and biases pointers of the options point at these.
    let with_opts = inp.byte();
    let dim = match inp.byte() % 8 {
        7 => inp.byte() as i8 as c_int,
        k => (k % 3) as c_int,
    };
    let reduce = (inp.byte() % 4) as i32;
    let num_b = match inp.byte() % 8 {
        7 => inp.byte() as i8 as c_int,
        _ => n as c_int,
    };
    // Sometimes NULL entries in the biases' array (torch's Tensor?[]).
    if inp.byte() % 4 == 0 {
        ts[9].data = std::ptr::null_mut();
    }
    // Result scales: ag_mm's point at the biases' descriptors, mm_rs's at its bias's.
    let with_result_scales = inp.byte() % 2 == 1;
    // The descriptors the call reads: ag_mm's a_shard, ag_out, bs, outs,
    // a_scale, b_scales and biases; mm_rs's a, b, out and its three
    // options; lc_allgather's input and output.
    let flag = |bit: u8| with_opts & bit != 0;
    let used: Vec<usize> = match op {
        0 => [0]
            .into_iter()
            .chain(flag(2).then_some(1))
            .chain(2..2 + 2 * n)
            .chain(flag(4).then_some(6))
            .chain((7..7 + n).filter(|_| flag(8)))
            .chain((9..9 + n).filter(|_| flag(16) || with_result_scales))
            .collect(),
        1 => [0, 1, 2]
            .into_iter()
            .chain([3, 4, 5].into_iter().filter(|&i| flag(1 << (i - 1)) || (i == 5 && with_result_scales)))
            .collect(),
        _ => vec![0, 1],
    };
    let count_ok = usize::try_from(num_b).map_or(true, |b| b <= n);
    if !used.iter().all(|&i| callable(&ts[i], f.arena)) || !count_ok {
        return;
    }
    // Sizes of a version (40, 48), too small (8) or anything up to 64,
    // fields cut in half among them.
    let size_field = match with_opts % 4 {
        0 => 0usize,
        1 => [8, inp.byte() as usize % 65][inp.byte() as usize % 2],
        2 => 48,
        _ => 40,
    };
    let g = f.group as symm_group_t;
    // SAFETY: the arena and its guard are ARENA + GUARD bytes.
    let arena = unsafe { std::slice::from_raw_parts_mut(f.arena as *mut u8, ARENA + GUARD) };
    arena.iter_mut().enumerate().for_each(|(i, b)| *b = (i as u8).wrapping_mul(31) ^ 0x3c);
    let before = arena.to_vec();
    let p = ts.as_ptr();
    // SAFETY: every descriptor is callable (above); arrays hold the counts
    // passed; option structs are full-size and zero-padded.
    let st = unsafe {
        match op {
            0 => {
                let o = symm_ag_mm_options_t {
                    struct_size: size_field,
                    a_scale: if with_opts & 4 != 0 { p.add(6) } else { std::ptr::null() },
                    b_scales: if with_opts & 8 != 0 { p.add(7) } else { std::ptr::null() },
                    biases: if with_opts & 16 != 0 { p.add(9) } else { std::ptr::null() },
                    algorithm: (with_opts >> 5) as i32 % 5,
                    result_scales: if with_result_scales { p.add(9) } else { std::ptr::null() },
                };
                let opts = padded(&o);
                let opts_ptr =
                    if size_field == 0 { std::ptr::null() } else { opts.as_ptr() as *const symm_ag_mm_options_t };
                let ag = if with_opts & 2 != 0 { p.add(1) } else { std::ptr::null() };
                symm_fused_ag_mm(g, p, p.add(2), num_b, dim, ag, p.add(2 + n), opts_ptr, std::ptr::null_mut())
            }
            1 => {
                let o = symm_mm_rs_options_t {
                    struct_size: size_field,
                    a_scale: if with_opts & 4 != 0 { p.add(3) } else { std::ptr::null() },
                    b_scale: if with_opts & 8 != 0 { p.add(4) } else { std::ptr::null() },
                    bias: if with_opts & 16 != 0 { p.add(5) } else { std::ptr::null() },
                    algorithm: (with_opts >> 5) as i32 % 5,
                    result_scale: if with_result_scales { p.add(5) } else { std::ptr::null() },
                };
                let opts = padded(&o);
                let opts_ptr =
                    if size_field == 0 { std::ptr::null() } else { opts.as_ptr() as *const symm_mm_rs_options_t };
                symm_mm_rs(g, p, p.add(1), dim, reduce, p.add(2), opts_ptr, std::ptr::null_mut())
            }
            _ => symm_lc_allgather(g, p, p.add(1), std::ptr::null_mut()),
        }
    };
    assert!(known(st), "unknown status {st}");
    // SAFETY: symm_last_error returns a NUL-terminated string.
    let msg = unsafe { CStr::from_ptr(symm_last_error()) }.to_string_lossy().into_owned();
    assert_ne!(st, SYMM_ERROR_INTERNAL, "internal error: {msg}");
    if arena[ARENA..] != before[ARENA..] {
        let shown: Vec<String> = used
            .iter()
            .map(|&i| {
                let t = &ts[i];
                let d = t.ndim.clamp(0, 8) as usize;
                format!(
                    "[{i}] dtype {} shape {:?} strides {:?} at {:?}",
                    t.dtype,
                    &t.shape[..d],
                    &t.strides[..d],
                    (t.data as usize).wrapping_sub(f.arena)
                )
            })
            .collect();
        panic!("op {op} status {st}: a write past every tensor given (dim {dim}, num_b {num_b}): {shown:?}");
    }
    if st != SYMM_SUCCESS {
        assert!(!msg.is_empty(), "status {st} without a message");
        assert!(arena == &before[..], "a failing call (status {st}: {msg}) wrote memory");
    }
    let mut health = -1;
    // SAFETY: out-pointer valid.
    assert_eq!(unsafe { symm_group_health(g, &mut health) }, SYMM_SUCCESS);
    assert_eq!(health, SYMM_SUCCESS, "a one-rank group failed: {msg}");
});
