use super::*;

/// Naive column-major `D = op(A) op(B)` as cuBLASLt defines it.
fn colmajor_ref(cm: &ColMajor, a: &[f64], b: &[f64], d: &mut [f64]) {
    let at = |i: u64, p: u64| {
        let (r, c) = if cm.a.trans { (p, i) } else { (i, p) };
        a[(c as i64 * cm.a.ld + r as i64) as usize]
    };
    let bt = |p: u64, j: u64| {
        let (r, c) = if cm.b.trans { (j, p) } else { (p, j) };
        b[(c as i64 * cm.b.ld + r as i64) as usize]
    };
    for i in 0..cm.m {
        for j in 0..cm.n {
            let s: f64 = (0..cm.k).map(|p| at(i, p) * bt(p, j)).sum();
            d[(j as i64 * cm.c.ld + i as i64) as usize] = s;
        }
    }
}

fn value(seed: usize) -> f64 {
    ((seed * 7919 + 13) % 97) as f64 - 48.0
}

/// Row-major reference and the col-major mapping agree for every
/// transpose combination and padded leading dimensions.
#[test]
fn row_major_maps_onto_column_major() {
    let (m, n, k) = (5usize, 3usize, 4usize);
    for (a_trans, b_trans) in [(false, false), (true, false), (false, true), (true, true)] {
        let lda = if a_trans { m + 2 } else { k + 1 };
        let ldb = if b_trans { k + 3 } else { n + 1 };
        let ldc = n + 2;
        let a_rows = if a_trans { k } else { m };
        let b_rows = if b_trans { n } else { k };
        let a: Vec<f64> = (0..a_rows * lda).map(value).collect();
        let b: Vec<f64> = (0..b_rows * ldb).map(|i| value(i + 1000)).collect();
        let a_el = |i: usize, p: usize| if a_trans { a[p * lda + i] } else { a[i * lda + p] };
        let b_el = |p: usize, j: usize| if b_trans { b[j * ldb + p] } else { b[p * ldb + j] };
        let mut p = MatmulParams::new(m, n, k, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        (p.lda, p.ldb, p.ldc, p.a_trans, p.b_trans) = (lda, ldb, ldc, a_trans, b_trans);
        p.validate().unwrap();
        let (cm, pa, pb) = ColMajor::from_row_major(&p);
        assert_eq!((pa, pb), (0x2000, 0x1000), "A' is the caller's B");
        assert_eq!((cm.m, cm.n, cm.k), (n as u64, m as u64, k as u64));
        // Stored shapes fit their leading dimensions.
        for o in [cm.a, cm.b, cm.c] {
            assert!(o.ld as u64 >= o.rows, "{o:?}");
        }
        let mut d = vec![f64::NAN; m * ldc];
        colmajor_ref(&cm, &b, &a, &mut d);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|q| a_el(i, q) * b_el(q, j)).sum();
                assert_eq!(d[i * ldc + j], want, "C[{i},{j}] trans=({a_trans},{b_trans})");
            }
        }
    }
}

#[test]
fn validation() {
    let ok = MatmulParams::new(64, 32, 16, 0x1000, 0x2000, 0x3000, GemmDtype::F16);
    ok.validate().unwrap();
    let mut p = ok;
    p.lda = 15;
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::InvalidArgument);
    p = ok;
    p.a_trans = true;
    assert!(p.validate().is_err(), "transposed A needs lda >= m");
    p.lda = 64;
    p.validate().unwrap();
    p = ok;
    p.b_trans = true;
    p.ldb = 16;
    p.validate().unwrap();
    p = ok;
    p.ldc = 31;
    assert!(p.validate().is_err());
    p = ok;
    p.out_dtype = GemmDtype::F32;
    p.validate().unwrap();
    p.dtype = GemmDtype::F32;
    p.validate().unwrap();
    p.out_dtype = GemmDtype::BF16;
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported);
    p = ok;
    p.dtype = GemmDtype::BF16;
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "bf16 into f16");
    p = ok;
    p.b = 0;
    assert!(p.validate().is_err());
    p = ok;
    p.c = 0x3001;
    assert!(p.validate().is_err(), "misaligned C");
    p = ok;
    p.sm_count_target = Some(0);
    assert!(p.validate().is_err());
    p = ok;
    p.workspace = Some((0x1000, 0));
    assert!(p.validate().is_err());
    // Empty problems are valid (and no-ops), even with NULL pointers.
    p = MatmulParams::new(0, 32, 16, 0, 0, 0, GemmDtype::F32);
    p.validate().unwrap();
    // k == 0 needs only C.
    p = MatmulParams::new(4, 4, 0, 0, 0, 0x100, GemmDtype::F32);
    p.validate().unwrap();
    p.ldc = 3;
    assert!(p.validate().is_err());
}

#[test]
fn batch_validation_and_keys() {
    let mut p = MatmulParams::new(4, 8, 16, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
    (p.batch, p.stride_a, p.stride_b, p.stride_c) = (3, 64, 0, 40);
    p.validate().unwrap();
    let (cm, ..) = ColMajor::from_row_major(&p);
    // A' is the caller's B (shared: stride 0), B' the caller's A.
    assert_eq!((cm.batch, cm.a.stride, cm.b.stride, cm.c.stride), (3, 0, 64, 40));
    let mut q = p;
    q.stride_c = 31;
    assert_eq!(q.validate().unwrap_err().kind, ErrorKind::InvalidArgument, "C's products overlap");
    q = p;
    q.batch = 0;
    assert_eq!(q.validate().unwrap_err().kind, ErrorKind::InvalidArgument);
    q = p;
    q.fp8 = Some(Fp8Params {
        a_type: Fp8::E4M3,
        b_type: Fp8::E4M3,
        row_wise: false,
        a_scale: 0x100,
        b_scale: 0x200,
        bias: 0,
        fast_accum: false,
    });
    (q.b_trans, q.ldb) = (true, 16);
    assert_eq!(q.validate().unwrap_err().kind, ErrorKind::Unsupported, "fp8 is not batched");
    // One product: strides are not part of its key.
    let one = MatmulParams { batch: 1, ..p };
    let (cm, ..) = ColMajor::from_row_major(&one);
    assert_eq!((cm.batch, cm.a.stride, cm.b.stride, cm.c.stride), (1, 0, 0, 0));
    // The alignment of every matrix in the batch: 40 bf16 = 80 bytes apart is 16-byte aligned.
    assert_eq!(batch_alignment(0x3000, 40, 2), 16);
    assert_eq!(batch_alignment(0x3000, 0, 2), 256);
    assert_eq!(batch_alignment(0x3000, 3, 2), 2);
}

#[test]
fn fp8_validation() {
    let f = Fp8Params {
        a_type: Fp8::E4M3,
        b_type: Fp8::E5M2,
        row_wise: true,
        a_scale: 0x100,
        b_scale: 0x200,
        bias: 0,
        fast_accum: false,
    };
    let mut ok = MatmulParams::new(64, 32, 16, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
    (ok.b_trans, ok.ldb, ok.fp8) = (true, 16, Some(f));
    ok.validate().unwrap();
    let mut p = ok;
    p.b_trans = false;
    p.ldb = 32;
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "B must be K-major");
    p = ok;
    p.fp8 = Some(Fp8Params { a_type: Fp8::E5M2, ..f });
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "E5M2 x E5M2");
    p = ok;
    p.fp8 = Some(Fp8Params { a_scale: 0, ..f });
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::InvalidArgument);
    p = ok;
    p.out_dtype = GemmDtype::F32;
    p.validate().unwrap();
    p.fp8 = Some(Fp8Params { bias: 0x400, ..f });
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "no bias into f32");
    // fp8 operands are one byte: an odd address is aligned.
    p = ok;
    p.a = 0x1001;
    p.validate().unwrap();
}

#[test]
fn alignment_classes() {
    assert_eq!(alignment_class(0x1000), 256);
    assert_eq!(alignment_class(0x1010), 16);
    assert_eq!(alignment_class(0x1002), 2);
    assert_eq!(alignment_class(0x1080), 128);
    assert_eq!(alignment_class(0), 256);
}

#[test]
fn dtype_sizes_and_indices() {
    assert_eq!(GemmDtype::F32.size(), 4);
    assert_eq!(GemmDtype::BF16.size(), 2);
    assert_eq!(GemmDtype::F16.size(), 2);
    // The reduction kernels are indexed by these values (kernels/reduce.cu SYMM_DT_*).
    assert_eq!(GemmDtype::F32 as usize, 0);
    assert_eq!(GemmDtype::BF16 as usize, 1);
    assert_eq!(GemmDtype::F16 as usize, 2);
}

// ---- on a GPU (pass vacuously without one) ----

use crate::backend::cuda::gpu_testing::{
    capture_and_replay, decode, encode, fp8_bytes, gpu, time_ms, values, DevBuf, Gpu,
};

/// Device buffers and the host reference for one problem.
struct Case {
    p: MatmulParams,
    bufs: [DevBuf; 3],
    c: Vec<f32>,
    expect: Vec<f64>,
}

/// Builds `p`'s operands (random, as stored, with padding), C's initial
/// contents and the expected result. `shift` moves every pointer by
/// that many elements (to exercise weaker alignment).
fn setup(g: &Gpu, mut p: MatmulParams, shift: usize) -> Case {
    let (s, so) = (p.dtype.size(), p.out_dtype.size());
    let a_rows = if p.a_trans { p.k } else { p.m };
    let b_rows = if p.b_trans { p.n } else { p.k };
    let q = |v: Vec<f32>, t| decode(t, &encode(t, &v));
    let a = q(values(a_rows * p.lda + shift, 1), p.dtype);
    let b = q(values(b_rows * p.ldb + shift, 2), p.dtype);
    let c = q(values(p.m * p.ldc + shift, 3), p.out_dtype);
    let bufs = [g.upload(&encode(p.dtype, &a)), g.upload(&encode(p.dtype, &b)), g.upload(&encode(p.out_dtype, &c))];
    p.a = bufs[0].ptr + (shift * s) as u64;
    p.b = bufs[1].ptr + (shift * s) as u64;
    p.c = bufs[2].ptr + (shift * so) as u64;
    let a_el = |i: usize, t: usize| if p.a_trans { a[shift + t * p.lda + i] } else { a[shift + i * p.lda + t] };
    let b_el = |t: usize, j: usize| if p.b_trans { b[shift + j * p.ldb + t] } else { b[shift + t * p.ldb + j] };
    let mut expect = vec![0f64; p.m * p.n];
    for i in 0..p.m {
        for j in 0..p.n {
            let dot: f64 = (0..p.k).map(|t| a_el(i, t) as f64 * b_el(t, j) as f64).sum();
            let old = if p.accumulate { c[shift + i * p.ldc + j] as f64 } else { 0.0 };
            expect[i * p.n + j] = p.alpha as f64 * dot + old;
        }
    }
    Case { p, bufs, c, expect }
}

fn verify(case: &Case, what: &str) {
    let p = &case.p;
    let so = p.out_dtype.size();
    let shift = (p.c - case.bufs[2].ptr) as usize / so;
    let got = decode(p.out_dtype, &case.bufs[2].read_bytes());
    let tol = match (p.dtype, p.out_dtype) {
        (_, GemmDtype::BF16) => 1.0 / 64.0,
        (_, GemmDtype::F16) => 1.0 / 512.0,
        (GemmDtype::F32, _) => 1e-5,
        _ => 1e-4,
    };
    for i in 0..p.m {
        for j in 0..p.ldc {
            let idx = shift + i * p.ldc + j;
            if j >= p.n {
                assert_eq!(got[idx].to_bits(), case.c[idx].to_bits(), "{what}: padding C[{i},{j}] was written");
                continue;
            }
            let want = case.expect[i * p.n + j];
            let err = (got[idx] as f64 - want).abs();
            assert!(err <= tol * (want.abs() + (p.k as f64).sqrt()), "{what}: C[{i},{j}] = {} want {want}", got[idx]);
        }
    }
}

#[test]
fn gpu_matmul_matches_host() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    use GemmDtype::*;
    let shapes = [(64usize, 48usize, 40usize), (129, 67, 33), (1, 256, 512), (300, 1, 70), (256, 256, 1024)];
    let types = [(BF16, BF16), (BF16, F32), (F16, F16), (F16, F32), (F32, F32)];
    for (m, n, k) in shapes {
        for (dt, ot) in types {
            for (a_trans, b_trans) in [(false, false), (true, false), (false, true), (true, true)] {
                for (pad, shift, accumulate) in [(0, 0, false), (8, 0, true), (3, 1, false)] {
                    let mut p = MatmulParams::new(m, n, k, 0, 0, 0, dt);
                    p.out_dtype = ot;
                    (p.a_trans, p.b_trans, p.accumulate) = (a_trans, b_trans, accumulate);
                    p.lda = if a_trans { m } else { k } + pad;
                    p.ldb = if b_trans { k } else { n } + pad;
                    p.ldc = n + pad;
                    p.alpha = if accumulate { 0.5 } else { 1.0 };
                    let case = setup(&g, p, shift);
                    let what = format!("{:?}", case.p);
                    gemm.matmul(&case.p, g.stream()).unwrap_or_else(|e| panic!("{what}: {e}"));
                    g.sync();
                    verify(&case, &what);
                }
            }
        }
    }
    // An SM count target, a workspace of our own, k == 0.
    let mut p = MatmulParams::new(512, 384, 256, 0, 0, 0, BF16);
    p.sm_count_target = Some(16);
    let ws = gemm.alloc_workspace().unwrap();
    p.workspace = ws.as_param();
    let case = setup(&g, p, 0);
    gemm.matmul(&case.p, g.stream()).unwrap();
    g.sync();
    verify(&case, "sm_count_target 16, own workspace");
    for accumulate in [false, true] {
        let mut p = MatmulParams::new(33, 20, 0, 0, 0, 0, BF16);
        (p.ldc, p.accumulate) = (24, accumulate);
        let case = setup(&g, p, 0);
        gemm.matmul(&case.p, g.stream()).unwrap();
        g.sync();
        verify(&case, &format!("k == 0, accumulate {accumulate}"));
    }
    assert!(gemm.cached_matmuls() > 100);
}

/// Strided-batched matmuls against a float64 reference: A and C with
/// gaps between their matrices (C's rows padded too), everything of C
/// outside the products poisoned (NaN) and checked untouched; B shared
/// (batch stride 0) or one per batch, row- or column-major; every
/// input type; sequence slices of 3 and 11 rows; accumulating too.
#[test]
fn gpu_batched_matmul_matches_host() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    use GemmDtype::*;
    let shapes = [(2usize, 3usize, 8usize, 16usize), (4, 11, 40, 24), (3, 64, 48, 40), (2, 128, 256, 64)];
    let types = [(BF16, BF16), (BF16, F32), (F16, F16), (F16, F32), (F32, F32)];
    let modes = [(true, false, false), (true, true, false), (false, false, true), (false, true, false)];
    for (batch, m, n, k) in shapes {
        for (dt, ot) in types {
            for (shared_b, b_trans, accumulate) in modes {
                let (lda, ldb, ldc) = (k, if b_trans { k } else { n }, n + 3);
                let stride_a = m * lda + 8;
                let stride_b = if shared_b { 0 } else { k * n + 8 };
                let stride_c = m * ldc + 5;
                let q = |v: Vec<f32>, t| decode(t, &encode(t, &v));
                let a = q(values(batch * stride_a, 1), dt);
                let b = q(values(if shared_b { k * n } else { batch * stride_b }, 2), dt);
                let mut c = q(values(batch * stride_c, 3), ot);
                let mut held = vec![false; c.len()];
                for t in 0..batch {
                    for i in 0..m {
                        (0..n).for_each(|j| held[t * stride_c + i * ldc + j] = true);
                    }
                }
                c.iter_mut().zip(&held).filter(|(_, &h)| !h).for_each(|(v, _)| *v = f32::NAN);
                let c = q(c, ot);
                let bufs = [g.upload(&encode(dt, &a)), g.upload(&encode(dt, &b)), g.upload(&encode(ot, &c))];
                let mut p = MatmulParams::new(m, n, k, bufs[0].ptr, bufs[1].ptr, bufs[2].ptr, dt);
                (p.out_dtype, p.ldb, p.b_trans, p.ldc, p.accumulate) = (ot, ldb, b_trans, ldc, accumulate);
                (p.batch, p.stride_a, p.stride_b, p.stride_c) = (batch, stride_a, stride_b, stride_c);
                let what = format!("{p:?}");
                gemm.matmul(&p, g.stream()).unwrap_or_else(|e| panic!("{what}: {e}"));
                g.sync();
                let got = decode(ot, &bufs[2].read_bytes());
                let tol = match (dt, ot) {
                    (_, BF16) => 1.0 / 64.0,
                    (_, F16) => 1.0 / 512.0,
                    (F32, _) => 1e-5,
                    _ => 1e-4,
                };
                let b_el = |t: usize, x: usize, j: usize| {
                    let base = t * stride_b;
                    if b_trans {
                        b[base + j * ldb + x]
                    } else {
                        b[base + x * ldb + j]
                    }
                };
                for (idx, _) in held.iter().enumerate().filter(|(_, &h)| !h) {
                    assert_eq!(got[idx].to_bits(), c[idx].to_bits(), "{what}: the gap at {idx} was written");
                }
                for t in 0..batch {
                    for i in 0..m {
                        for j in 0..n {
                            let dot: f64 =
                                (0..k).map(|x| a[t * stride_a + i * lda + x] as f64 * b_el(t, x, j) as f64).sum();
                            let idx = t * stride_c + i * ldc + j;
                            let want = dot + if accumulate { c[idx] as f64 } else { 0.0 };
                            let err = (got[idx] as f64 - want).abs();
                            assert!(
                                err <= tol * (want.abs() + (k as f64).sqrt()),
                                "{what}: C[{t}][{i},{j}] = {} want {want}",
                                got[idx]
                            );
                        }
                    }
                }
            }
        }
    }
    // Products of C must not overlap.
    let mut p = MatmulParams::new(8, 8, 8, 0x1000, 0x2000, 0x3000, BF16);
    (p.batch, p.stride_c) = (2, 32);
    assert_eq!(p.validate().unwrap_err().kind, ErrorKind::InvalidArgument, "overlapping C");
}

/// cuBLASLt fp8 against a float64 reference of `torch._scaled_mm`:
/// both operand-type mixes, tensor-wise and row-wise scales (the scale
/// pointers swap with the operands), bias, padded leading dimensions, and
/// accumulated onto C's old values (which are not scaled).
#[test]
fn gpu_fp8_matmul_matches_host() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    let (m, n, k) = (96usize, 80usize, 64usize);
    for (at, bt) in [(Fp8::E4M3, Fp8::E4M3), (Fp8::E4M3, Fp8::E5M2), (Fp8::E5M2, Fp8::E4M3)] {
        for row_wise in [false, true] {
            let outs = [(GemmDtype::BF16, true), (GemmDtype::F16, false), (GemmDtype::F32, false)];
            for ((out, bias), accumulate) in outs.into_iter().flat_map(|o| [(o, false), (o, true)]) {
                let (lda, ldb, ldc) = (k + 16, k, n + 8);
                let a = fp8_bytes(m * lda, 1, at); // row-major [m, k], padded rows
                let b = fp8_bytes(n * ldb, 2, bt); // column-major [k, n]: B^T row-major [n, k]
                let sa: Vec<f32> = (0..if row_wise { m } else { 1 }).map(|i| 0.25 + (i % 7) as f32 / 4.0).collect();
                let sb: Vec<f32> = (0..if row_wise { n } else { 1 }).map(|j| 1.5 - (j % 5) as f32 / 8.0).collect();
                let bias_v: Vec<f32> = (0..n).map(|j| decode(out, &encode(out, &[j as f32 / 16.0 - 2.0]))[0]).collect();
                let old = decode(out, &encode(out, &values(m * ldc, 3)));
                let bufs = [g.upload(&a), g.upload(&b), g.upload(&encode(out, &old))];
                let (dsa, dsb, dbias) = (g.upload(&sa), g.upload(&sb), g.upload(&encode(out, &bias_v)));
                let mut p = MatmulParams::new(m, n, k, bufs[0].ptr, bufs[1].ptr, bufs[2].ptr, out);
                (p.lda, p.ldb, p.ldc, p.b_trans, p.accumulate) = (lda, ldb, ldc, true, accumulate);
                let bias_ptr = if bias { dbias.ptr } else { 0 };
                p.fp8 = Some(Fp8Params {
                    a_type: at,
                    b_type: bt,
                    row_wise,
                    a_scale: dsa.ptr,
                    b_scale: dsb.ptr,
                    bias: bias_ptr,
                    fast_accum: false,
                });
                let what =
                    format!("{at:?} x {bt:?} row_wise {row_wise} into {out:?} bias {bias} accumulate {accumulate}");
                gemm.matmul(&p, g.stream()).unwrap_or_else(|e| panic!("{what}: {e}"));
                g.sync();
                let got = decode(out, &bufs[2].read_bytes());
                let tol = match out {
                    GemmDtype::BF16 => 1.0 / 128.0,
                    GemmDtype::F16 => 1.0 / 1024.0,
                    _ => 1e-5,
                };
                for i in 0..m {
                    for j in 0..n {
                        let terms = (0..k).map(|t| at.decode(a[i * lda + t]) as f64 * bt.decode(b[j * ldb + t]) as f64);
                        let (dot, magnitude) = terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                        let scale = sa[if row_wise { i } else { 0 }] as f64 * sb[if row_wise { j } else { 0 }] as f64;
                        let added = if accumulate { old[i * ldc + j] as f64 } else { 0.0 };
                        let want = dot * scale + if bias { bias_v[j] as f64 } else { 0.0 } + added;
                        let err = (got[i * ldc + j] as f64 - want).abs();
                        // Hopper's fp8 tensor cores accumulate with about
                        // 14 mantissa bits between cuBLASLt's promotions to
                        // f32 (measured: 5e-5 relative on an H200), so the
                        // bound grows with the sum of |terms|, not the result.
                        let accumulation = magnitude * scale / 4096.0;
                        assert!(
                            err <= tol * (want.abs() + 1.0) + accumulation,
                            "{what}: C[{i},{j}] = {} want {want}",
                            got[i * ldc + j]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_matmul_in_graph_capture() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    // A shape seen before capture (cached matmul) ...
    let mut p = MatmulParams::new(256, 192, 128, 0, 0, 0, GemmDtype::BF16);
    p.accumulate = true;
    let warm = setup(&g, p, 0);
    gemm.matmul(&warm.p, g.stream()).unwrap();
    g.sync();
    let case = setup(&g, p, 0);
    // ... and one first seen during capture (heuristic query in capture).
    let fresh = setup(&g, MatmulParams::new(96, 80, 72, 0, 0, 0, GemmDtype::F16), 0);
    let before = gemm.cached_matmuls();
    capture_and_replay(&g, 1, || {
        gemm.matmul(&case.p, g.stream()).unwrap();
        gemm.matmul(&fresh.p, g.stream()).unwrap();
    });
    assert_eq!(gemm.cached_matmuls(), before + 1);
    verify(&case, "captured, cached matmul, accumulate, replayed once");
    verify(&fresh, "captured, matmul made during capture");
}

/// Where a matmul whose candidates are worth timing stands after its first
/// call outside capture: timed, unless `SYMM_GEMM_TUNE=0`.
fn timed_once_seen() -> Tuning {
    if crate::config::gemm_tune() {
        Tuning::Done
    } else {
        Tuning::Pending(0)
    }
}

/// A matmul with few rows and a large B times cuBLASLt's candidates on
/// its first call outside capture, once, and writes the product (and not
/// C's padding) whichever it keeps; one first seen during capture, or
/// accumulated into, keeps the first choice untimed.
#[test]
fn gpu_decode_matmul_times_its_candidates_once() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    // 16 rows against B of 4096 x n bf16, K-major (a Linear weight), C padded.
    let decode = |n: usize| {
        let mut p = MatmulParams::new(16, n, 4096, 0, 0, 0, GemmDtype::BF16);
        (p.b_trans, p.ldb, p.ldc) = (true, 4096, n + 8);
        p
    };
    let first = setup(&g, decode(2048), 0);
    assert!(tune::worth_it(&first.p), "B of 16 MiB is timed");
    gemm.matmul(&first.p, g.stream()).unwrap();
    g.sync();
    let timed = timed_once_seen();
    assert_eq!(gemm.tuning(&first.p), Some(timed), "after the first call");
    verify(&first, "first call (candidates timed into C, then the call)");
    let second = setup(&g, decode(2048), 0);
    gemm.matmul(&second.p, g.stream()).unwrap();
    g.sync();
    assert_eq!(gemm.tuning(&second.p), Some(timed));
    verify(&second, "second call (the kept candidate)");

    let captured = setup(&g, decode(2304), 0);
    capture_and_replay(&g, 1, || gemm.matmul(&captured.p, g.stream()).unwrap());
    assert_eq!(gemm.tuning(&captured.p), Some(Tuning::Pending(0)), "nothing timed during capture");
    verify(&captured, "first seen during capture");

    let mut p = decode(2560);
    p.accumulate = true;
    let accumulated = setup(&g, p, 0);
    gemm.matmul(&accumulated.p, g.stream()).unwrap();
    g.sync();
    assert_eq!(gemm.tuning(&accumulated.p), Some(Tuning::Pending(0)), "an accumulated output is not timed");
    verify(&accumulated, "accumulated into");
}

/// A mid-sized matmul (a pipelined path's piece, at a row count where
/// cuBLASLt's first choice can be slow) times its candidates too and
/// writes the product whichever it keeps; a new one whose trial would
/// overrun what is left of the device's `tune::BUDGET_MS` keeps the first
/// choice untimed, one that fits it is timed.
#[test]
fn gpu_mid_sized_matmul_times_its_candidates_within_the_budget() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    let mid = |m: usize| {
        let mut p = MatmulParams::new(m, 1024, 1024, 0, 0, 0, GemmDtype::BF16);
        (p.b_trans, p.ldb, p.ldc) = (true, 1024, 1024 + 8);
        p
    };
    let first = setup(&g, mid(2000), 0);
    assert!(tune::worth_it(&first.p), "4.2 GFLOP is timed");
    gemm.matmul(&first.p, g.stream()).unwrap();
    g.sync();
    let timed = timed_once_seen();
    assert_eq!(gemm.tuning(&first.p), Some(timed), "after the first call");
    verify(&first, "mid-sized, first call (candidates timed into C, then the call)");

    let over = setup(&g, mid(2008), 0);
    assert!(tune::worth_it(&over.p));
    gemm.lock().tuning_spent_ms = tune::BUDGET_MS - tune::cost_ms(&over.p) / 2.0;
    gemm.matmul(&over.p, g.stream()).unwrap();
    g.sync();
    assert_eq!(gemm.tuning(&over.p), Some(Tuning::Pending(0)), "past the budget: not timed");
    verify(&over, "mid-sized, past the budget");

    let fits = setup(&g, mid(2016), 0);
    let left = tune::BUDGET_MS - tune::cost_ms(&fits.p) - 1.0;
    gemm.lock().tuning_spent_ms = left;
    gemm.matmul(&fits.p, g.stream()).unwrap();
    g.sync();
    assert_eq!(gemm.tuning(&fits.p), Some(timed), "the budget's last trial");
    if crate::config::gemm_tune() {
        let spent = gemm.lock().tuning_spent_ms;
        assert!((spent - (tune::BUDGET_MS - 1.0)).abs() < 1e-6, "the trial's cost counted: {spent}");
    }
    verify(&fits, "mid-sized, the budget's last trial");
}

/// An fp8 matmul of decode size (row-wise scales: the scale pointers are
/// set for the candidates too) times its candidates and writes the
/// scaled product, and not C's padding.
#[test]
fn gpu_decode_fp8_matmul_times_its_candidates() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    let (m, n, k, ldc) = (16usize, 4096usize, 4096usize, 4096 + 8);
    let a = fp8_bytes(m * k, 1, Fp8::E4M3);
    let b = fp8_bytes(n * k, 2, Fp8::E4M3); // B^T row-major [n, k]
    let sa: Vec<f32> = (0..m).map(|i| 0.25 + (i % 7) as f32 / 4.0).collect();
    let sb: Vec<f32> = (0..n).map(|j| 1.5 - (j % 5) as f32 / 8.0).collect();
    let poison = encode(GemmDtype::BF16, &vec![f32::NAN; m * ldc]);
    let bufs = [g.upload(&a), g.upload(&b), g.upload(&poison)];
    let (dsa, dsb) = (g.upload(&sa), g.upload(&sb));
    let mut p = MatmulParams::new(m, n, k, bufs[0].ptr, bufs[1].ptr, bufs[2].ptr, GemmDtype::BF16);
    (p.ldb, p.ldc, p.b_trans) = (k, ldc, true);
    p.fp8 = Some(Fp8Params {
        a_type: Fp8::E4M3,
        b_type: Fp8::E4M3,
        row_wise: true,
        a_scale: dsa.ptr,
        b_scale: dsb.ptr,
        bias: 0,
        fast_accum: false,
    });
    assert!(tune::worth_it(&p), "B of 16 MiB in fp8 is timed");
    match gemm.matmul(&p, g.stream()) {
        // cuBLASLt before 12.9 has no row-wise scales.
        Err(e) if e.kind == ErrorKind::Unsupported => return,
        r => r.unwrap(),
    }
    g.sync();
    let timed = timed_once_seen();
    assert_eq!(gemm.tuning(&p), Some(timed));
    let got = decode(GemmDtype::BF16, &bufs[2].read_bytes());
    for i in 0..m {
        for j in 0..ldc {
            let v = got[i * ldc + j];
            if j >= n {
                assert!(v.is_nan(), "padding C[{i},{j}] was written");
                continue;
            }
            let terms = (0..k).map(|t| Fp8::E4M3.decode(a[i * k + t]) as f64 * Fp8::E4M3.decode(b[j * k + t]) as f64);
            let (dot, magnitude) = terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
            let scale = sa[i] as f64 * sb[j] as f64;
            let want = dot * scale;
            // As gpu_fp8_matmul_matches_host: bf16's rounding and the
            // tensor cores' accumulation between promotions.
            let bound = (want.abs() + 1.0) / 128.0 + magnitude * scale / 4096.0;
            assert!((v as f64 - want).abs() <= bound, "C[{i},{j}] = {v} want {want}");
        }
    }
}

/// TFLOP/s of large bf16 matmuls, with and without an SM target (run
/// with --ignored on a GPU machine).
#[test]
#[ignore]
fn gpu_matmul_throughput() {
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    for (m, n, k) in [(8192usize, 8192usize, 8192usize), (16384, 8192, 8192), (4096, 4096, 4096)] {
        let a = g.alloc(m * k * 2);
        let b = g.alloc(k * n * 2);
        let c = g.alloc(m * n * 2);
        for target in [None, Some(120), Some(100)] {
            let mut p = MatmulParams::new(m, n, k, a.ptr, b.ptr, c.ptr, GemmDtype::BF16);
            p.sm_count_target = target;
            let ms = time_ms(&g, 3, 10, || gemm.matmul(&p, g.stream()).unwrap());
            let tflops = 2.0 * (m * n * k) as f64 / (ms as f64 / 1e3) / 1e12;
            eprintln!("matmul bf16 {m}x{n}x{k} sm_target={target:?}: {ms:.3} ms, {tflops:.0} TFLOP/s");
        }
    }
}

#[test]
fn missing_cublaslt_is_an_error_not_a_panic() {
    // Without the library this is Unsupported with a message; with it,
    // the version is at least 12.0.
    match ensure_cublaslt() {
        Ok(v) => assert!(v >= MIN_VERSION),
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::Unsupported);
            assert!(e.msg.contains("cuBLASLt"), "{}", e.msg);
        }
    }
}

/// Every cuBLASLt entry point this module's code (tests aside) calls is in
/// `LT_SYMBOLS`, checked before first use, so a library that lacks one
/// gives an error, never cudarc's panic.
#[test]
fn every_cublaslt_call_is_checked_up_front() {
    let sources =
        [include_str!("mod.rs"), include_str!("lt_matmul.rs"), include_str!("params.rs"), include_str!("tune.rs")];
    let mut unchecked = Vec::new();
    for source in sources {
        for call in source.split("lt::cublasLt").skip(1) {
            let name: String = call.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let name = format!("cublasLt{name}");
            // Types and constants (`lt::cublasLtHandle_t`...) are not calls.
            let is_call = call[name.len() - "cublasLt".len()..].trim_start().starts_with('(');
            if is_call && !LT_SYMBOLS.contains(&name.as_str()) {
                unchecked.push(name);
            }
        }
    }
    assert!(unchecked.is_empty(), "cuBLASLt calls not in LT_SYMBOLS: {unchecked:?}");
}
