use super::*;
use crate::array::DType;
use crate::ops::testing::host_facts;

fn call(a: &[usize], b: &[usize], dim: i64, out: &[usize]) -> MmRs {
    MmRs {
        a: Array::contiguous(0x100_0000, DType::F16, a),
        b: Array::contiguous(0x200_0000, DType::F16, b),
        scatter_dim: dim,
        op: ReduceOp::Avg,
        out: Array::contiguous(0x300_0000, DType::F16, out),
        scales: MmRsScales::default(),
        algorithm: None,
    }
}

#[test]
fn output_chunks_for_each_dim() {
    assert!(call(&[4, 3, 5], &[5, 6], 0, &[2, 3, 6]).prepare(&host_facts(2), "host", false).is_ok());
    assert!(call(&[4, 3, 5], &[5, 6], 2, &[4, 3, 3]).prepare(&host_facts(2), "host", false).is_ok());
    let e = call(&[4, 3, 5], &[5, 6], 1, &[4, 1, 6]).prepare(&host_facts(2), "host", false).unwrap_err();
    assert_eq!(
        e.msg,
        "dimension 1 of a @ b ([4, 3, 6]) has size 3, which the world size 2 does not divide; expected a multiple of 2"
    );
    let e = call(&[4, 3, 5], &[5, 6], 0, &[4, 3, 6]).prepare(&host_facts(2), "host", false).unwrap_err();
    assert_eq!(e.msg, "out.shape is [4, 3, 6]; expected [2, 3, 6]");
    let e = call(&[4, 3, 5], &[4, 6], 0, &[2, 3, 6]).prepare(&host_facts(2), "host", false).unwrap_err();
    assert_eq!(e.msg, "b.shape[0] is 4; expected 5, a's last dimension");
}

/// An fp8 call: e4m3 `a` [8, 32], e4m3 column-major `b` [32, n], f32 out.
fn fp8_call(dim: i64, n: usize, world: usize, row_wise: bool) -> MmRs {
    let mut out = [8, n];
    out[dim as usize] /= world;
    let mut c = call(&[8, 32], &[32, n], dim, &out);
    c.a.dtype = DType::F8E4M3;
    c.b = Array { dtype: DType::F8E4M3, strides: vec![1, 32], ..c.b };
    c.out.dtype = DType::F32;
    let scale = |i: u64, shape: &[usize]| Some(Array::contiguous(0x7000_0000 + 0x1000 * i, DType::F32, shape));
    c.scales = MmRsScales {
        a_scale: scale(0, &if row_wise { vec![8, 1] } else { vec![1, 1] }),
        b_scale: scale(1, &if row_wise { vec![1, n] } else { vec![1] }),
        bias: None,
        result_scale: None,
    };
    c
}

#[test]
fn fp8_plans() {
    let p = fp8_call(0, 16, 2, true).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!(p.mode, Some(Mode::Row));
    // Chunks of 4 x 16 f32; a packed as 8 x 32 bytes; 8 row scales;
    // room for B's 16 row scales copied aligned (no bias); regions
    // start 256 bytes apart.
    assert_eq!(p.chunks, vec![0, 256]);
    assert_eq!(
        (p.packed_a, p.packed_scale, p.b_vectors),
        (1280, Some(1536), Some(BVectors { scale: 1792, bias: None }))
    );
    assert_eq!(p.workspace, 1792 + 16 * 4);
    // Tensor-wise: room for one scale each, copied aligned.
    let p = fp8_call(0, 16, 2, false).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!((p.packed_scale, p.b_vectors), (Some(1536), Some(BVectors { scale: 1792, bias: None })));
    // Scattering N: each rank's N (here 32 / 2) must be a multiple of 16.
    assert!(fp8_call(1, 32, 2, true).prepare(&host_facts(2), "host", false).is_ok());
    assert!(fp8_call(1, 16, 2, true).prepare(&host_facts(2), "host", false).unwrap_err().msg.contains("N = 8"));
    // A bias needs a bf16/f16 output.
    let mut c = fp8_call(0, 16, 2, false);
    c.scales.bias = Some(Array::contiguous(0x7100_0000, DType::F32, &[16]));
    assert_eq!(c.prepare(&host_facts(2), "host", false).unwrap_err().kind, crate::error::ErrorKind::Unsupported);
    // Row-wise a_scale has a's shape with the last dimension 1.
    let mut c = fp8_call(0, 16, 2, true);
    c.scales.a_scale = Some(Array::contiguous(0x7000_0000, DType::F32, &[1, 8]));
    assert!(c
        .prepare(&host_facts(2), "host", false)
        .unwrap_err()
        .msg
        .starts_with("opts->a_scale.shape is [1, 8]; expected [8, 1]"));
    // A bf16 b with an fp8 a is a type error, a row-major fp8 b a layout one.
    let mut c = fp8_call(0, 16, 2, false);
    c.b.dtype = DType::BF16;
    assert_eq!(
        c.prepare(&host_facts(2), "host", false).unwrap_err().msg,
        "b.dtype is bf16; expected an fp8 type, as a is fp8_e4m3"
    );
    let mut c = fp8_call(0, 16, 2, false);
    c.b.strides = vec![16, 1];
    assert_eq!(c.prepare(&host_facts(2), "host", false).unwrap_err().kind, crate::error::ErrorKind::Unsupported);
}

#[test]
fn workspace_holds_chunks_staging_and_packed_a() {
    let p = call(&[4, 3, 5], &[5, 6], 0, &[1, 3, 6]).prepare(&host_facts(4), "host", false).unwrap();
    // Chunks of 18 f16 (36 bytes): one per rank back to back, then at
    // 256-byte steps a staged copy per rank, the reduced chunk, 60 f16 of a.
    assert_eq!(p.chunks, vec![0, 36, 72, 108]);
    assert_eq!(p.staged, vec![256, 512, 768, 1024]);
    assert_eq!(p.reduced, 1280);
    assert_eq!((p.packed_a, p.workspace), (1536, 1536 + 120));
}

#[test]
fn own_chunk_multiplied_onto_pulls_only_for_two_ranks_summing_rows() {
    let pieces = |world: usize, f: &dyn Fn(&mut MmRs)| {
        let mut c = call(&[2048, 8], &[8, 16], 0, &[2048 / world, 16]);
        c.op = ReduceOp::Sum;
        f(&mut c);
        let plan = c.prepare(&host_facts(world), "host", false).unwrap();
        // The cost model is told the same pieces.
        assert_eq!(plan.shape.split_len, plan.onto_pieces.unwrap_or(1));
        plan.onto_pieces
    };
    assert_eq!(pieces(2, &|_| {}), Some(2));
    assert_eq!(pieces(2, &|c| c.op = ReduceOp::Avg), None);
    assert_eq!(pieces(4, &|_| {}), None);
    // Whether `out` is contiguous is not agreed between ranks: it
    // changes where the partials land, not the pieces.
    assert_eq!(pieces(2, &|c| c.out.strides = vec![32, 1]), Some(2));
    let mut small = call(&[1024, 8], &[8, 16], 0, &[512, 16]);
    small.op = ReduceOp::Sum;
    assert_eq!(small.prepare(&host_facts(2), "host", false).unwrap().onto_pieces, None); // one piece
    let mut big = call(&[32768, 8], &[8, 16], 0, &[16384, 16]);
    big.op = ReduceOp::Sum;
    assert_eq!(big.prepare(&host_facts(2), "host", false).unwrap().onto_pieces, Some(MAX_PIECES));
    // [batch, seq, hidden] scattered along the sequence: pieces of the
    // batch, no more than it has.
    let seq = |a: &[usize], dim: i64, out: &[usize]| {
        let mut c = call(a, &[8, 16], dim, out);
        c.op = ReduceOp::Sum;
        c.prepare(&host_facts(2), "host", false).unwrap().onto_pieces
    };
    assert_eq!(seq(&[8, 1024, 8], 1, &[8, 512, 16]), Some(MAX_PIECES));
    assert_eq!(seq(&[3, 1024, 8], 1, &[3, 512, 16]), Some(MAX_PIECES));
    assert_eq!(seq(&[3, 800, 8], 1, &[3, 400, 16]), Some(2)); // 1200 rows
    assert_eq!(seq(&[1, 8192, 8], 1, &[1, 4096, 16]), None); // one batch
    assert_eq!(seq(&[8, 1024, 8], 0, &[4, 1024, 16]), None); // dim 0 of a 3-D a
}

/// `call` on `g` (of two ranks) by the path onto the pulled partials in
/// two pieces, the peer's chunk in them too or whole.
fn run_onto(g: &Arc<Group>, call: MmRs, theirs_in_pieces: bool) {
    let mut plan = call.prepare(&host_facts(2), "host", false).unwrap();
    plan.decision.algorithm = Algorithm::Pipelined;
    plan.decision.pieces = if theirs_in_pieces { 2 } else { 1 };
    assert_eq!(plan.onto_pieces, Some(2));
    let tag = crate::backend::CallTag::of(b"mm_rs");
    super::super::launch(g, Stream(0), &plan, tag, &|_, make| crate::backend::ReplayKey::new(make())).unwrap();
}

/// fp8 operands by the path onto the pulled partials (the own pieces
/// accumulated by scaled matmuls): e4m3 `a` [2048, 32] of -1, 0 and 1
/// and a column-major e4m3 `b`, so that every sum is exact; row-wise
/// power-of-two scales into f32, and tensor-wise ones with a bf16 bias
/// (in each rank's product, so twice in the sum) into bf16, contiguous
/// or every other row of a buffer (whose rows between must stay
/// untouched). Every element checked against the exact sum; rows are
/// 1024 a chunk, two pieces.
#[test]
fn two_ranks_sum_fp8_products_exactly_onto_pulled_partials() {
    use crate::fp8::Fp8;
    use crate::ops::testing::{host_groups, on_each};
    let (m, k, n) = (2048usize, 32usize, 16usize);
    let rows = m / 2;
    let groups = host_groups(2);
    let value = |r: usize, i: usize| ((i * 7 + r * 5 + i / 13) % 3) as f32 - 1.0;
    // Per rank: a row-major [m, k]; b column-major (b^T row-major [n, k]).
    let a: Vec<Vec<u8>> = (0..2).map(|r| (0..m * k).map(|i| Fp8::E4M3.encode(value(r, i))).collect()).collect();
    let b: Vec<u8> = (0..n * k).map(|i| Fp8::E4M3.encode(value(2, i))).collect();
    let a_scale = |r: usize, i: usize| [0.5f32, 1.0, 2.0][(i + r) % 3];
    let b_scale = |j: usize| [1.0f32, 0.25, 4.0][j % 3];
    let bias = |j: usize| [0.0f32, 1.0, -2.0][j % 3];
    for (row_wise, out_dtype, gap) in [(true, DType::F32, 1), (false, DType::BF16, 1), (false, DType::BF16, 2)] {
        let want = |r: usize, i: usize, j: usize| -> f64 {
            (0..2)
                .map(|q| {
                    let row = r * rows + i;
                    let dot: f64 = (0..k)
                        .map(|t| (Fp8::E4M3.decode(a[q][row * k + t]) * Fp8::E4M3.decode(b[j * k + t])) as f64)
                        .sum();
                    match row_wise {
                        true => dot * (a_scale(q, row) * b_scale(j)) as f64,
                        false => dot + bias(j) as f64,
                    }
                })
                .sum()
        };
        assert!((0..n).any(|j| want(1, 5, j) != 0.0) && (0..n).any(|j| want(0, 3, j) != want(0, 3, 0)));
        let outs = on_each(&groups, |r, g| {
            // 16-byte aligned storage for every vector.
            let aligned = |bytes: &[u8]| -> Vec<u128> {
                let mut v = vec![0u128; bytes.len().div_ceil(16)];
                // SAFETY: the vector holds at least `bytes.len()` bytes.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len()) };
                v
            };
            let f32s = |v: Vec<f32>| aligned(&v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>());
            let mut av = aligned(&a[r]);
            let mut bv = aligned(&b);
            let (sa, sb) = match row_wise {
                true => ((0..m).map(|i| a_scale(r, i)).collect(), (0..n).map(b_scale).collect()),
                false => (vec![1.0f32], vec![1.0f32]),
            };
            let (mut sa, mut sb) = (f32s(sa), f32s(sb));
            let bias_bytes: Vec<u8> =
                (0..n).flat_map(|j| half::bf16::from_f32(bias(j)).to_bits().to_ne_bytes()).collect();
            let mut biasv = aligned(&bias_bytes);
            let mut out = vec![u128::MAX; (rows * gap * n * out_dtype.size()).div_ceil(16)]; // NaN-poisoned
            let at = |v: &mut Vec<u128>, dtype, shape: &[usize]| Array::contiguous(v.as_mut_ptr() as u64, dtype, shape);
            let call = MmRs {
                a: at(&mut av, DType::F8E4M3, &[m, k]),
                b: Array { strides: vec![1, k], ..at(&mut bv, DType::F8E4M3, &[k, n]) },
                scatter_dim: 0,
                op: ReduceOp::Sum,
                out: Array { strides: vec![gap * n, 1], ..at(&mut out, out_dtype, &[rows, n]) },
                scales: MmRsScales {
                    a_scale: Some(at(&mut sa, DType::F32, &if row_wise { vec![m, 1] } else { vec![1, 1] })),
                    b_scale: Some(at(&mut sb, DType::F32, &if row_wise { vec![1, n] } else { vec![1] })),
                    bias: (!row_wise).then(|| at(&mut biasv, DType::BF16, &[n])),
                    result_scale: None,
                },
                algorithm: None,
            };
            run_onto(g, call, true);
            out
        });
        for (r, out) in outs.iter().enumerate() {
            let size = out_dtype.size();
            // SAFETY: `rows * gap * n` elements of `out_dtype` were allocated.
            let bytes = unsafe { std::slice::from_raw_parts(out.as_ptr() as *const u8, rows * gap * n * size) };
            for i in 0..rows {
                let between = &bytes[((i * gap + 1) * n * size)..((i + 1) * gap * n * size)];
                assert!(between.iter().all(|&b| b == 0xff), "rank {r} wrote between the rows of out");
                for j in 0..n {
                    let at = (i * gap * n + j) * size;
                    let got = match out_dtype {
                        DType::F32 => f32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap()),
                        _ => half::bf16::from_bits(u16::from_ne_bytes([bytes[at], bytes[at + 1]])).to_f32(),
                    };
                    let what = format!("row-wise {row_wise}, row stride {gap} x n, rank {r}, element ({i}, {j})");
                    assert_eq!(got as f64, want(r, i, j), "{what}");
                }
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// Two ranks by the path onto the pulled partials, bf16 small integers
/// so that every sum is exact: matrices of 1024 rows a chunk scattered
/// by rows, and `[3, 800, k]` along the sequence (two pieces of 1 and 2
/// batches); the peer's chunk whole or in pieces; `out` contiguous, or
/// every other row of a buffer (whose rows between must stay untouched).
#[test]
fn two_ranks_sum_exactly_when_own_pieces_go_onto_pulled_partials() {
    use crate::ops::testing::{host_groups, on_each};
    use half::bf16;
    let (k, n) = (8usize, 16usize);
    let groups = host_groups(2);
    // (batch, seq, spread): a is [2 * seq, k] by rows (batch 0) or
    // [batch, 2 * seq, k], its elements `spread` apart (2: no matrix nor
    // batch of matrices, packed; NaN between them).
    let layouts = [(0usize, 1024usize, 1usize), (3, 400, 1)];
    let modes = [(false, 1usize), (true, 1), (true, 2), (false, 2)];
    let spread = [((0, 1024, 2), (false, 1)), ((3, 400, 2), (true, 2))];
    let cases = layouts.iter().flat_map(|l| modes.map(|m| (*l, m))).chain(spread);
    for ((batch, seq, spread), (theirs_in_pieces, gap)) in cases {
        let what = format!(
            "batch {batch}, a's elements {spread} apart, peer's chunk in pieces: {theirs_in_pieces}, row stride {gap} x n"
        );
        let rows = batch.max(1) * seq; // of a chunk
        let value = |r: usize, i: usize| ((i * 5 + r * 3 + i / 11) % 7) as f32 - 3.0;
        let a: Vec<Vec<bf16>> =
            (0..2).map(|r| (0..2 * rows * k).map(|i| bf16::from_f32(value(r, i))).collect()).collect();
        let spread_a = |v: &[bf16]| -> Vec<bf16> {
            v.iter().flat_map(|&x| std::iter::once(x).chain(std::iter::repeat_n(bf16::NAN, spread - 1))).collect()
        };
        let b: Vec<bf16> = (0..k * n).map(|i| bf16::from_f32(value(2, i))).collect();
        // Row i of rank r's chunk of rank q's product.
        let product = |q: usize, r: usize, i: usize, c: usize| -> f32 {
            let row = (i / seq) * 2 * seq + r * seq + i % seq;
            (0..k).map(|p| a[q][row * k + p].to_f32() * b[p * n + c].to_f32()).sum()
        };
        // Neither operand is constant or zero (a check that could not fail).
        assert!(b.iter().any(|x| x.to_f32() != b[0].to_f32()) && product(0, 1, 5, 3) + product(1, 1, 5, 3) != 0.0);
        let (a_shape, out_shape, strides, dim) = match batch {
            0 => (vec![2 * seq, k], vec![seq, n], vec![gap * n, 1], 0),
            _ => (vec![batch, 2 * seq, k], vec![batch, seq, n], vec![seq * gap * n, gap * n, 1], 1),
        };
        let outs = on_each(&groups, |r, g| {
            let mut a = spread_a(&a[r]);
            let mut b = b.clone();
            let mut out = vec![bf16::NAN; rows * n * gap];
            let arr = |v: &mut [bf16], shape: &[usize]| Array::contiguous(v.as_mut_ptr() as u64, DType::BF16, shape);
            let a = arr(&mut a, &a_shape);
            let call = MmRs {
                a: Array { strides: a.strides.iter().map(|s| s * spread).collect(), ..a },
                b: arr(&mut b, &[k, n]),
                scatter_dim: dim,
                op: ReduceOp::Sum,
                out: Array { strides: strides.clone(), ..arr(&mut out, &out_shape) },
                scales: MmRsScales::default(),
                algorithm: None,
            };
            run_onto(g, call, theirs_in_pieces);
            out
        });
        for (r, out) in outs.iter().enumerate() {
            for (i, got) in out.iter().enumerate() {
                let (line, c) = (i / n, i % n);
                if line % gap != 0 {
                    assert!(got.is_nan(), "{what}: rank {r} wrote between the rows of out");
                    continue;
                }
                let want = product(0, r, line / gap, c) + product(1, r, line / gap, c);
                assert_eq!(got.to_f32(), want, "{what}: rank {r}, row {} of its chunk, column {c}", line / gap);
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}
