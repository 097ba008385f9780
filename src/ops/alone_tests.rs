//! A group of one rank: the gathered A is the shard, the reduced product
//! the rank's own; each operation multiplies the caller's memory in place
//! (`AgMmPrepared::alone`, `MmRsPrepared::alone`) or, where it cannot,
//! takes its general path. Every layout must give the product: small
//! integers in f32, so every element is exact; NaN in the outputs first,
//! so an unwritten one shows.

use super::testing::host_groups;
use super::{fused_ag_mm, mm_rs, AgMm, AgMmScales, MmRs, MmRsScales, ReduceOp};
use crate::array::{Array, DType};
use crate::backend::Stream;

fn val(i: usize, salt: usize) -> f32 {
    ((i * 7 + salt * 13) % 11) as f32 - 5.0
}

fn at(v: &[f32], shape: &[usize]) -> Array {
    Array::contiguous(v.as_ptr() as u64, DType::F32, shape)
}

/// `a` (rows x k, row-major) times `b` (k x n) at (row, j).
fn product(a: &[f32], b: &[f32], k: usize, n: usize, row: usize, j: usize) -> f32 {
    (0..k).map(|h| a[row * k + h] * b[h * n + j]).sum()
}

#[test]
fn one_rank_gathers_and_multiplies_every_layout() {
    let g = &host_groups(1)[0];
    // (shard, gather dim, shard column-major, `ag_out` rows padded):
    // matrices and batches along dim 0, a batch's sequence (dim 1), K (the
    // last: the general path), and a column-major shard, whose copy into a
    // padded `ag_out` no backend makes (the general path stages it).
    let cases = [
        (vec![7usize, 5], 0i64, false, false),
        (vec![3, 2, 5], 0, false, false),
        (vec![3, 2, 5], 1, false, false),
        (vec![4, 5], 1, false, false),
        (vec![7, 5], 0, false, true),
        (vec![7, 5], 0, true, false),
        (vec![7, 5], 0, true, true),
    ];
    for (shard, dim, col_major, padded) in cases {
        let k = *shard.last().unwrap();
        let rows = shard.iter().product::<usize>() / k;
        let ns = [3usize, 2];
        let what = format!("{shard:?} along {dim} (column-major {col_major}, ag_out padded {padded})");
        // Element (row, h) of the shard, wherever the layout keeps it.
        let a: Vec<f32> = (0..rows * k).map(|i| val(i, 1)).collect();
        let stored: Vec<f32> = match col_major {
            false => a.clone(),
            true => (0..rows * k).map(|i| a[(i % rows) * k + i / rows]).collect(),
        };
        let mut a_arr = at(&stored, &shard);
        if col_major {
            a_arr.strides = vec![1, rows];
        }
        let bs: Vec<Vec<f32>> =
            ns.iter().enumerate().map(|(i, &n)| (0..k * n).map(|e| val(e, 2 + i)).collect()).collect();
        let outs: Vec<Vec<f32>> = ns.iter().map(|&n| vec![f32::NAN; rows * n]).collect();
        let ld = if padded { k + 3 } else { k };
        let ag = vec![f32::NAN; rows * ld];
        let mut ag_arr = at(&ag, &shard);
        if padded {
            ag_arr.strides = vec![ld, 1];
        }
        let lead = &shard[..shard.len() - 1];
        let out_shape = |n: usize| lead.iter().copied().chain([n]).collect::<Vec<_>>();
        let call = AgMm {
            a_shard: a_arr,
            bs: bs.iter().zip(ns).map(|(b, n)| at(b, &[k, n])).collect(),
            gather_dim: dim,
            ag_out: Some(ag_arr),
            outs: outs.iter().zip(ns).map(|(o, n)| at(o, &out_shape(n))).collect(),
            scales: AgMmScales::default(),
            algorithm: None,
        };
        fused_ag_mm(g, Ok(call), Stream(0)).unwrap();
        for (i, &n) in ns.iter().enumerate() {
            for row in 0..rows {
                for j in 0..n {
                    let want = product(&a, &bs[i], k, n, row, j);
                    assert_eq!(outs[i][row * n + j], want, "{what}: outs[{i}][{row}, {j}]");
                }
            }
        }
        for row in 0..rows {
            for h in 0..ld {
                let got = ag[row * ld + h];
                match h < k {
                    true => assert_eq!(got, a[row * k + h], "{what}: ag_out[{row}, {h}]"),
                    false => assert!(got.is_nan(), "{what}: ag_out's padding at [{row}, {h}] was written"),
                }
            }
        }
    }
}

#[test]
fn one_rank_reduce_scatters_every_layout() {
    let g = &host_groups(1)[0];
    // (A, scatter dim, out's row pitch): a matrix into a contiguous and
    // into a padded `out`, a batch along its sequence, N (the last dim).
    for (shape, dim, pitch) in
        [(vec![6usize, 5], 0i64, 0usize), (vec![6, 5], 0, 2), (vec![2, 3, 5], 1, 0), (vec![6, 5], 1, 0)]
    {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let (k, n) = (*shape.last().unwrap(), 4usize);
            let rows = shape.iter().product::<usize>() / k;
            let a: Vec<f32> = (0..rows * k).map(|i| val(i, 3)).collect();
            let b: Vec<f32> = (0..k * n).map(|e| val(e, 4)).collect();
            let ld = n + pitch;
            let out = vec![f32::NAN; rows * ld];
            let out_shape: Vec<usize> = shape[..shape.len() - 1].iter().copied().chain([n]).collect();
            let mut out_arr = at(&out, &out_shape);
            if pitch > 0 {
                out_arr.strides = vec![ld, 1];
            }
            let call = MmRs {
                a: at(&a, &shape),
                b: at(&b, &[k, n]),
                scatter_dim: dim,
                op,
                out: out_arr,
                scales: MmRsScales::default(),
                algorithm: None,
            };
            mm_rs(g, Ok(call), Stream(0)).unwrap();
            for row in 0..rows {
                for j in 0..ld {
                    let got = out[row * ld + j];
                    match j < n {
                        true => {
                            assert_eq!(got, product(&a, &b, k, n, row, j), "{shape:?} along {dim} {op:?}: [{row}, {j}]")
                        }
                        false => assert!(got.is_nan(), "{shape:?}: the padding at [{row}, {j}] was written"),
                    }
                }
            }
        }
    }
}
