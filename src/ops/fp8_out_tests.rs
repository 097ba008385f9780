//! fp8 outputs of `fused_ag_mm` and `mm_rs` on the host backend, worlds 1
//! to 4, both algorithms, against a reference built here: products and
//! sums of the decoded fp8 inputs in f64 (exact: the inputs are small
//! dyadic numbers and the scales powers of two), the documented f32
//! epilogue (average, bias, result scale), then the nearest fp8 code found
//! by searching the decoded table (ties to the even code, saturating),
//! not `Fp8::encode`. Outputs are poisoned and compared bit for bit; each
//! case must meet ties, saturation and NaN, so that it tests them.

use super::testing::{host_groups, lines_calls, on_each};
use super::{fused_ag_mm, mm_rs, AgMm, AgMmScales, MmRs, MmRsScales, ReduceOp};
use crate::array::{Array, DType};
use crate::backend::Stream;
use crate::cost::Algorithm;
use crate::fp8::Fp8;
use half::bf16;

const K: usize = 32;
const POISON: u8 = 0xa5;

/// 16-byte aligned bytes (fp8 B and matrices need aligned rows).
struct Buf(Vec<u128>);

impl Buf {
    fn new(bytes: usize, fill: u8) -> Buf {
        Buf(vec![u128::from_ne_bytes([fill; 16]); bytes.div_ceil(16)])
    }
    fn from_bytes(b: &[u8]) -> Buf {
        let mut buf = Buf::new(b.len(), 0);
        buf.bytes_mut()[..b.len()].copy_from_slice(b);
        buf
    }
    fn from_f32(v: &[f32]) -> Buf {
        Buf::from_bytes(&v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>())
    }
    fn from_bf16(v: &[f32]) -> Buf {
        Buf::from_bytes(&v.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_ne_bytes()).collect::<Vec<u8>>())
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.0.len() * 16;
        // SAFETY: the vector's storage, viewed as bytes.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut u8, n) }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.0.len() * 16) }
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn array(&self, dtype: DType, shape: &[usize], strides: &[usize]) -> Array {
        Array { addr: self.addr(), dtype, shape: shape.to_vec(), strides: strides.to_vec() }
    }
}

fn hash(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small dyadic value, exact in every format used here.
fn value(tag: u64, rank: usize, i: usize) -> f32 {
    const V: [f32; 13] = [0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0];
    V[(hash(tag * 1000 + rank as u64 * 100_003 + i as u64) % V.len() as u64) as usize]
}

/// The code of an exactly representable value, from the decoded table.
fn code(fmt: Fp8, v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    (0..=255u8).find(|&b| fmt.decode(b) == v && (v != 0.0 || b == 0)).expect("representable")
}

fn format(d: DType) -> Fp8 {
    d.fp8().expect("an fp8 type")
}

/// The nearest finite code to `v`, ties to the even code, past the largest
/// finite value clamped to it; NaN to 0x7f.
fn nearest(fmt: Fp8, v: f64) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let mut best = 0u8;
    let mut max = 0.0f64;
    for b in 0..0x80u8 {
        let x = fmt.decode(b) as f64;
        if x.is_finite() {
            max = max.max(x);
        }
    }
    let a = v.abs().min(max);
    for b in 0..0x80u8 {
        let x = fmt.decode(b) as f64;
        if !x.is_finite() {
            continue;
        }
        let (d, db) = ((x - a).abs(), (fmt.decode(best) as f64 - a).abs());
        if d < db || (d == db && b % 2 == 0) {
            best = b;
        }
    }
    best | if v < 0.0 { 0x80 } else { 0 }
}

/// What the outputs met: ties between two codes, saturation, NaN.
#[derive(Default, Debug)]
struct Seen {
    ties: usize,
    saturated: usize,
    nan: usize,
}

impl Seen {
    fn note(&mut self, fmt: Fp8, v: f32) {
        let c = nearest(fmt, v as f64) & 0x7f;
        let (x, max) = (v.abs() as f64, fmt.max() as f64);
        if v.is_nan() {
            self.nan += 1;
        } else if x > max {
            self.saturated += 1;
        } else if c > 0 && c < 0x7e && {
            let (lo, hi) = (fmt.decode(c - 1) as f64, fmt.decode(c + 1) as f64);
            let here = fmt.decode(c) as f64;
            x == (lo + here) / 2.0 || x == (here + hi) / 2.0
        } {
            self.ties += 1;
        }
    }
    fn all(&self) -> bool {
        self.ties > 0 && self.saturated > 0 && self.nan > 0
    }
}

/// One all-gather + matmul case: shards `[rows, K]` gathered along
/// `gather_dim` (0: rows, 1: K); two outputs, the first fp8 (`outs[0]`,
/// with a bf16 bias, a result scale and a padded row stride), the
/// second `second` (fp8 without options, or bf16).
/// Returns each rank's count of launches on the LL lines (`None`: none).
fn ag_mm_case(
    world: usize,
    algorithm: Algorithm,
    row_wise: bool,
    gather_dim: usize,
    first: DType,
    second: DType,
) -> Vec<Option<u32>> {
    let rows = 4;
    let (k_total, out_rows) = if gather_dim == 1 { (K * world, rows) } else { (K, rows * world) };
    let ns = [16usize, 32];
    let a_fmt = Fp8::E4M3;
    let b_fmt = if first == DType::F8E5M2 { Fp8::E4M3 } else { Fp8::E5M2 };
    let a_val = |r: usize, i: usize, j: usize| if (r, i, j) == (0, 1, 3) { f32::NAN } else { value(1, r, i * K + j) };
    let b_val = |q: usize, t: usize, k: usize, n: usize| value(10 + t as u64, q, k * ns[t] + n);
    let row_scale = |r: usize, i: usize| 2f32.powi(((r * 7 + i) % 4) as i32 - 2);
    let col_scale = |t: usize, n: usize| 2f32.powi(((n + t) % 3) as i32 - 1);
    let bias_val = |n: usize| ((n % 9) as f32 - 4.0) * 0.25;
    // Enough to push the largest products past the format's maximum.
    let result_scale = if first == DType::F8E4M3 { 16.0f32 } else { 2048.0 };
    let groups = host_groups(world);
    let outs = on_each(&groups, |r, g| {
        let a: Vec<u8> = (0..rows * K).map(|e| code(a_fmt, a_val(r, e / K, e % K))).collect();
        let a = Buf::from_bytes(&a);
        let bs: Vec<Buf> = (0..2)
            .map(|t| {
                let col_major: Vec<u8> =
                    (0..ns[t] * k_total).map(|e| code(b_fmt, b_val(r, t, e % k_total, e / k_total))).collect();
                Buf::from_bytes(&col_major)
            })
            .collect();
        let sa = if row_wise {
            Buf::from_f32(&(0..rows).map(|i| row_scale(r, i)).collect::<Vec<_>>())
        } else {
            Buf::from_f32(&[0.5])
        };
        let sbs: Vec<Buf> = (0..2)
            .map(|t| {
                if row_wise {
                    Buf::from_f32(&(0..ns[t]).map(|n| col_scale(t, n)).collect::<Vec<_>>())
                } else {
                    Buf::from_f32(&[2.0])
                }
            })
            .collect();
        let bias = Buf::from_bf16(&(0..ns[0]).map(bias_val).collect::<Vec<_>>());
        let rs = Buf::from_f32(&[result_scale]);
        // outs[0]: rows padded to 48 bytes; outs[1] contiguous.
        let ld0 = ns[0] + 32;
        let out_bytes = [out_rows * ld0, out_rows * ns[1] * second.size()];
        let outs: Vec<Buf> = out_bytes.iter().map(|&b| Buf::new(b, POISON)).collect();
        let scale_shape = if row_wise { vec![rows, 1] } else { vec![1] };
        let call = AgMm {
            a_shard: a.array(DType::F8E4M3, &[rows, K], &[K, 1]),
            bs: (0..2).map(|t| bs[t].array(b_fmt_dtype(b_fmt), &[k_total, ns[t]], &[1, k_total])).collect(),
            gather_dim: gather_dim as i64,
            ag_out: None,
            outs: vec![
                outs[0].array(first, &[out_rows, ns[0]], &[ld0, 1]),
                outs[1].array(second, &[out_rows, ns[1]], &[ns[1], 1]),
            ],
            scales: AgMmScales {
                a_scale: Some(sa.array(DType::F32, &scale_shape, &crate::array::contiguous_strides(&scale_shape))),
                b_scales: Some(
                    (0..2)
                        .map(|t| {
                            let shape = if row_wise { vec![1, ns[t]] } else { vec![1] };
                            sbs[t].array(DType::F32, &shape, &crate::array::contiguous_strides(&shape))
                        })
                        .collect(),
                ),
                biases: Some(vec![Some(bias.array(DType::BF16, &[ns[0]], &[1])), None]),
                result_scales: Some(vec![Some(rs.array(DType::F32, &[1], &[1])), None]),
            },
            algorithm: Some(algorithm),
        };
        fused_ag_mm(g, Ok(call), Stream(0)).unwrap();
        outs.iter().map(|b| b.bytes().to_vec()).collect::<Vec<_>>()
    });
    let what =
        format!("ag_mm world {world} {algorithm:?} row-wise {row_wise} gather_dim {gather_dim} {first} {second}");
    let mut seen = Seen::default();
    for (r, out) in outs.iter().enumerate() {
        for t in 0..2 {
            let dtype = if t == 0 { first } else { second };
            for i in 0..out_rows {
                for n in 0..ns[t] {
                    // Row i of the gathered A: (owner, row) of a shard; with K gathered, K blocks.
                    let mut dot = 0f64;
                    for k in 0..k_total {
                        let (q, row, kk) = if gather_dim == 1 { (k / K, i, k % K) } else { (i / rows, i % rows, k) };
                        dot += a_val(q, row, kk) as f64 * b_val(r, t, k, n) as f64;
                    }
                    let sa = if row_wise { row_scale(i / rows, i % rows) } else { 0.5 };
                    let sb = if row_wise { col_scale(t, n) } else { 2.0 };
                    // f32, as the matmul's epilogue: the scales' product, then the bias, then the result scale.
                    let mut v = (dot as f32) * (sa * sb);
                    if t == 0 {
                        v = (v + bf16::from_f32(bias_val(n)).to_f32()) * result_scale;
                    }
                    let got_at = if t == 0 { i * (ns[0] + 32) + n } else { (i * ns[1] + n) * dtype.size() };
                    match dtype.fp8() {
                        Some(fmt) => {
                            seen.note(fmt, v);
                            let got = out[t][got_at];
                            assert_eq!(got, nearest(fmt, v as f64), "{what}: rank {r} outs[{t}][{i}, {n}] = {v}");
                        }
                        None => {
                            let got = bf16::from_bits(u16::from_ne_bytes([out[t][got_at], out[t][got_at + 1]]));
                            let want = bf16::from_f32(v);
                            assert!(got == want || (got.is_nan() && want.is_nan()), "{what}: rank {r} outs[1]");
                        }
                    }
                }
                if t == 0 {
                    // The padding of every row stays poisoned.
                    assert!(out[0][i * (ns[0] + 32) + ns[0]..(i + 1) * (ns[0] + 32)].iter().all(|&b| b == POISON));
                }
            }
        }
    }
    assert!(seen.all(), "{what}: the outputs must meet ties, saturation and NaN: {seen:?}");
    let lines = groups.iter().map(|g| lines_calls(g)).collect();
    groups.iter().for_each(|g| g.release_scratch());
    lines
}

fn b_fmt_dtype(f: Fp8) -> DType {
    match f {
        Fp8::E4M3 => DType::F8E4M3,
        Fp8::E5M2 => DType::F8E5M2,
    }
}

#[test]
fn ag_mm_fp8_outputs_at_worlds_1_to_4() {
    for world in 1..=4 {
        for algorithm in [Algorithm::Sequential, Algorithm::Pipelined] {
            // Sequential, gathering rows: on the LL lines, row scales by a
            // second launch; gathering K or pipelined: not.
            let on_lines = |launches: u32| match (world, algorithm) {
                (2.., Algorithm::Sequential) => vec![Some(launches); world],
                _ => vec![None; world],
            };
            assert_eq!(ag_mm_case(world, algorithm, false, 0, DType::F8E4M3, DType::F8E5M2), on_lines(1));
            assert_eq!(ag_mm_case(world, algorithm, true, 0, DType::F8E5M2, DType::BF16), on_lines(2));
            assert_eq!(ag_mm_case(world, algorithm, false, 1, DType::F8E4M3, DType::BF16), vec![None; world]);
        }
    }
}

/// One matmul + reduce-scatter case: `a` `[4 * world, K]` (or `[4, K]`
/// scattering N), `b` `[K, 16 * world]` (or `[K, 16]`), out fp8 `fmt`,
/// transposed in memory (`transposed`) or contiguous, with a bf16 bias and
/// a result scale.
fn mm_rs_case(
    world: usize,
    algorithm: Algorithm,
    op: ReduceOp,
    row_wise: bool,
    scatter_dim: usize,
    out_dtype: DType,
    transposed: bool,
) {
    let (m, n) = if scatter_dim == 0 { (4 * world, 16) } else { (4, 16 * world) };
    // Each rank's chunk: 4 rows of a, or 16 columns of b.
    let (om, on) = (4, 16);
    let fmt = format(out_dtype);
    let (a_fmt, b_fmt) = (Fp8::E4M3, if fmt == Fp8::E5M2 { Fp8::E4M3 } else { Fp8::E5M2 });
    let a_val =
        |r: usize, i: usize, k: usize| if (r, i, k) == (world - 1, 2, 5) { f32::NAN } else { value(3, r, i * K + k) };
    let b_val = |r: usize, k: usize, j: usize| value(4, r, k * n + j);
    let row_scale = |r: usize, i: usize| 2f32.powi(((r * 5 + i) % 4) as i32 - 1);
    let col_scale = |j: usize| 2f32.powi((j % 3) as i32 - 1);
    let bias_val = |j: usize| ((j % 7) as f32 - 3.0) * 0.5;
    let result_scale = if fmt == Fp8::E4M3 { 16.0f32 } else { 2048.0 };
    let groups = host_groups(world);
    let outs = on_each(&groups, |r, g| {
        let a = Buf::from_bytes(&(0..m * K).map(|e| code(a_fmt, a_val(r, e / K, e % K))).collect::<Vec<_>>());
        let b = Buf::from_bytes(&(0..n * K).map(|e| code(b_fmt, b_val(r, e % K, e / K))).collect::<Vec<_>>());
        let sa = if row_wise {
            Buf::from_f32(&(0..m).map(|i| row_scale(r, i)).collect::<Vec<_>>())
        } else {
            Buf::from_f32(&[2.0])
        };
        let sb =
            if row_wise { Buf::from_f32(&(0..n).map(col_scale).collect::<Vec<_>>()) } else { Buf::from_f32(&[0.5]) };
        let bias = Buf::from_bf16(&(0..n).map(bias_val).collect::<Vec<_>>());
        let rs = Buf::from_f32(&[result_scale]);
        let out = Buf::new(om * on + 16, POISON);
        let out_strides = if transposed { [1, om] } else { [on, 1] };
        let (sa_shape, sb_shape) = if row_wise { (vec![m, 1], vec![1, n]) } else { (vec![1], vec![1]) };
        let call = MmRs {
            a: a.array(DType::F8E4M3, &[m, K], &[K, 1]),
            b: b.array(b_fmt_dtype(b_fmt), &[K, n], &[1, K]),
            scatter_dim: scatter_dim as i64,
            op,
            out: out.array(out_dtype, &[om, on], &out_strides),
            scales: MmRsScales {
                a_scale: Some(sa.array(DType::F32, &sa_shape, &crate::array::contiguous_strides(&sa_shape))),
                b_scale: Some(sb.array(DType::F32, &sb_shape, &crate::array::contiguous_strides(&sb_shape))),
                bias: Some(bias.array(DType::BF16, &[n], &[1])),
                result_scale: Some(rs.array(DType::F32, &[1], &[1])),
            },
            algorithm: Some(algorithm),
        };
        mm_rs(g, Ok(call), Stream(0)).unwrap();
        out.bytes()[..om * on + 16].to_vec()
    });
    let what = format!(
        "mm_rs world {world} {algorithm:?} {op:?} row-wise {row_wise} scatter_dim {scatter_dim} {out_dtype} transposed {transposed}"
    );
    let mut seen = Seen::default();
    for (r, out) in outs.iter().enumerate() {
        for i in 0..om {
            for j in 0..on {
                let (row, col) = if scatter_dim == 0 { (r * om + i, j) } else { (i, r * on + j) };
                // Every rank's product, exact in f64, summed.
                let mut sum = 0f64;
                for q in 0..world {
                    let dot: f64 = (0..K).map(|k| a_val(q, row, k) as f64 * b_val(q, k, col) as f64).sum();
                    let (sa, sb) = if row_wise { (row_scale(q, row), col_scale(col)) } else { (2.0, 0.5) };
                    sum += dot * sa as f64 * sb as f64;
                }
                // The documented f32 epilogue: average, bias (world times for a sum), result scale.
                let (avg, weight) = match op {
                    ReduceOp::Sum => (1.0f32, world as f32),
                    ReduceOp::Avg => (1.0 / world as f32, 1.0),
                };
                let v = ((sum as f32) * avg + weight * bf16::from_f32(bias_val(col)).to_f32()) * result_scale;
                seen.note(fmt, v);
                let at = if transposed { i + j * om } else { i * on + j };
                assert_eq!(out[at], nearest(fmt, v as f64), "{what}: rank {r} out[{i}, {j}] = {v} (exact sum {sum})");
            }
        }
        assert!(out[om * on..].iter().all(|&b| b == POISON), "{what}: past the output");
    }
    assert!(seen.all(), "{what}: the outputs must meet ties, saturation and NaN: {seen:?}");
    groups.iter().for_each(|g| g.release_scratch());
}

#[test]
fn mm_rs_fp8_outputs_at_worlds_1_to_4() {
    for world in 1..=4 {
        for algorithm in [Algorithm::Sequential, Algorithm::Pipelined] {
            mm_rs_case(world, algorithm, ReduceOp::Sum, false, 0, DType::F8E4M3, false);
            mm_rs_case(world, algorithm, ReduceOp::Avg, true, 0, DType::F8E5M2, true);
            mm_rs_case(world, algorithm, ReduceOp::Sum, true, 1, DType::F8E5M2, false);
            mm_rs_case(world, algorithm, ReduceOp::Avg, false, 1, DType::F8E4M3, true);
        }
    }
}
