use super::paths::piece_ranges;
use super::*;
use crate::array::DType;
use crate::error::ErrorKind;
use crate::ops::testing::host_facts;

/// A call on fake, well-separated addresses (planning never reads them).
fn call(shard: &[usize], dim: i64, b_rows: usize, ns: &[usize], out_lead: &[usize]) -> AgMm {
    let at = |i: u64, shape: &[usize]| Array::contiguous(0x100_0000 * (i + 1), DType::BF16, shape);
    let out_shape = |n: usize| out_lead.iter().copied().chain([n]).collect::<Vec<_>>();
    AgMm {
        a_shard: at(0, shard),
        bs: ns.iter().enumerate().map(|(i, &n)| at(1 + i as u64, &[b_rows, n])).collect(),
        gather_dim: dim,
        ag_out: None,
        outs: ns.iter().enumerate().map(|(i, &n)| at(10 + i as u64, &out_shape(n))).collect(),
        scales: AgMmScales::default(),
        algorithm: None,
    }
}

/// The pipelined path pulling (or pushed) each peer's shard in pieces,
/// both forced (the cost model picks them only at sizes too large for
/// a host test): 2-D and 3-D shards gathered along dim 0, 3-D and 4-D
/// ones along a middle
/// dimension (pieces of the batch), lengths the pieces do not divide,
/// more pieces than the shard's length, worlds 2, 3 and 8, with
/// `ag_out`; small integers in f32, so every element is exact, and NaN
/// in the outputs first, so an unwritten one shows.
#[test]
fn pipelined_pieces_gather_every_row() {
    use crate::ops::testing::{host_groups, on_each};
    let a_val = |r: usize, i: usize| ((r * 31 + i * 7) % 11) as f32 - 5.0;
    let b_val = |i: usize| ((i * 5) % 7) as f32 - 3.0;
    let cases = [
        (vec![7usize, 5], 0usize, 3usize),
        (vec![3, 2, 4], 0, 2),
        (vec![2, 6], 0, 5),
        (vec![3, 2, 4], 1, 2),
        (vec![5, 3, 4], 1, 3),
        (vec![3, 2, 2, 4], 2, 2),
    ];
    for (world, push) in [(2, false), (2, true), (3, false), (3, true), (8, false), (8, true)] {
        for (shard, dim, pieces) in cases.clone() {
            let (k, n) = (shard[shard.len() - 1], 3);
            let rows = shard.iter().product::<usize>() / k;
            let mut gathered = shard.clone();
            gathered[dim] *= world;
            let mut out_shape = gathered.clone();
            *out_shape.last_mut().unwrap() = n;
            let source = |g: usize| source_of(&shard, dim, world, g);
            let got = on_each(&host_groups(world), |r, g| {
                let a: Vec<f32> = (0..rows * k).map(|i| a_val(r, i)).collect();
                let b: Vec<f32> = (0..k * n).map(b_val).collect();
                let (out, ag) = (vec![f32::NAN; world * rows * n], vec![f32::NAN; world * rows * k]);
                let at = |v: &Vec<f32>, shape: &[usize]| Array::contiguous(v.as_ptr() as u64, DType::F32, shape);
                let call = AgMm {
                    a_shard: at(&a, &shard),
                    bs: vec![at(&b, &[k, n])],
                    gather_dim: dim as i64,
                    ag_out: Some(at(&ag, &gathered)),
                    outs: vec![at(&out, &out_shape)],
                    scales: AgMmScales::default(),
                    algorithm: Some(Algorithm::Pipelined),
                };
                assert_eq!(run_forced(g, call, pieces, push), pieces.min(shard[0]), "the pieces execute takes");
                (out, ag)
            });
            let what = |r: usize| format!("world {world} {shard:?} along {dim} in {pieces} (push {push}): rank {r}");
            for (r, (out, ag)) in got.iter().enumerate() {
                for row in 0..world * rows {
                    for j in 0..n {
                        let want: f32 = (0..k)
                            .map(|h| {
                                let (owner, at) = source(row * k + h);
                                a_val(owner, at) * b_val(h * n + j)
                            })
                            .sum();
                        assert_eq!(out[row * n + j], want, "{} row {row}", what(r));
                    }
                    for h in 0..k {
                        let (owner, at) = source(row * k + h);
                        assert_eq!(ag[row * k + h], a_val(owner, at), "{}: ag_out row {row}", what(r));
                    }
                }
            }
        }
    }
}

/// Pushed shards in each rank's own layout (the protocol is agreed;
/// the layouts are not): rank 0's contiguous, rank 1's rows apart
/// (pushed by pitched copies; staged with `ag_out`), rank 2's
/// column-major (staged, then pushed); worlds 2 and 3, whole and in
/// pieces, with and without `ag_out`. Small integers in f32, so every
/// element is exact; NaN in the outputs first.
#[test]
fn pushed_shards_in_every_layout() {
    use crate::ops::testing::{host_groups, on_each};
    let a_val = |r: usize, q: usize, h: usize| ((r * 31 + q * 7 + h * 3) % 11) as f32 - 5.0;
    let b_val = |i: usize| ((i * 5) % 7) as f32 - 3.0;
    let (rows, k, n) = (7usize, 5usize, 3usize);
    for world in [2, 3] {
        for (pieces, with_ag) in [(1, true), (3, true), (3, false)] {
            let got = on_each(&host_groups(world), |r, g| {
                // Element (q, h) of rank r's shard at `q * rs + h * cs`.
                let (rs, cs, len) = match r {
                    0 => (k, 1, rows * k),
                    1 => (k + 2, 1, rows * (k + 2)),
                    _ => (1, rows, rows * k),
                };
                let mut a = vec![f32::NAN; len];
                for q in 0..rows {
                    for h in 0..k {
                        a[q * rs + h * cs] = a_val(r, q, h);
                    }
                }
                let b: Vec<f32> = (0..k * n).map(b_val).collect();
                let (out, ag) = (vec![f32::NAN; world * rows * n], vec![f32::NAN; world * rows * k]);
                let at = |v: &Vec<f32>, shape: &[usize]| Array::contiguous(v.as_ptr() as u64, DType::F32, shape);
                let call = AgMm {
                    a_shard: Array {
                        addr: a.as_ptr() as u64,
                        dtype: DType::F32,
                        shape: vec![rows, k],
                        strides: vec![rs, cs],
                    },
                    bs: vec![at(&b, &[k, n])],
                    gather_dim: 0,
                    ag_out: with_ag.then(|| at(&ag, &[world * rows, k])),
                    outs: vec![at(&out, &[world * rows, n])],
                    scales: AgMmScales::default(),
                    algorithm: Some(Algorithm::Pipelined),
                };
                run_forced(g, call, pieces, true);
                (out, ag)
            });
            for (r, (out, ag)) in got.iter().enumerate() {
                for row in 0..world * rows {
                    let (owner, q) = (row / rows, row % rows);
                    for j in 0..n {
                        let want: f32 = (0..k).map(|h| a_val(owner, q, h) * b_val(h * n + j)).sum();
                        assert_eq!(out[row * n + j], want, "world {world} in {pieces}: rank {r} row {row}");
                    }
                    for h in (0..k).filter(|_| with_ag) {
                        assert_eq!(ag[row * k + h], a_val(owner, q, h), "world {world}: rank {r} ag_out row {row}");
                    }
                }
            }
        }
    }
}

/// `call` on `g` (a fresh group: no earlier call's prepared form) with
/// the decision's pieces and the choice to push forced (the cost model
/// takes pieces, and pushes, only at sizes too large for a host test);
/// the pieces it ran in.
fn run_forced(g: &Arc<Group>, call: AgMm, pieces: usize, push: bool) -> usize {
    let mut ran = 0;
    crate::ops::run_prepared(g, crate::backend::Stream(0), Ok(call), |c| {
        let signature = c.signature(None);
        let prepared = c.prepare(&Facts::of(g), "host", false).map(|mut p| {
            (p.decision.pieces, p.push) = (pieces, push);
            ran = p.pieces();
            p
        });
        (crate::ops::with_algorithm(signature, prepared.as_ref().map(|p| p.decision.algorithm)), prepared)
    })
    .unwrap();
    ran
}

/// Element `g` (row-major) of the A gathered from `world` shards of
/// shape `shard` along `dim`: its owner and its index in that shard.
fn source_of(shard: &[usize], dim: usize, world: usize, g: usize) -> (usize, usize) {
    let mut gathered = shard.to_vec();
    gathered[dim] *= world;
    let (mut idx, mut rest) = (vec![0; gathered.len()], g);
    for d in (0..gathered.len()).rev() {
        (idx[d], rest) = (rest % gathered[d], rest / gathered[d]);
    }
    let owner = idx[dim] / shard[dim];
    idx[dim] %= shard[dim];
    (owner, idx.iter().zip(shard).fold(0, |flat, (&i, &len)| flat * len + i))
}

/// A shard in a rendezvoused symmetric buffer is pulled by the peers
/// from where its caller has it: the same products as from ordinary
/// memory, pipelined (with and without `ag_out`) and sequential, along
/// dims 0 and 1, at worlds 2 and 3; a rank whose shard lies elsewhere
/// fails every rank with `Mismatch`, nothing written. Small integers in
/// f32: every element exact; outputs NaN first.
#[test]
fn symmetric_shards_are_pulled_in_place() {
    use crate::buffer::{rendezvous, Buffer};
    use crate::ops::testing::{host_groups, on_each};
    let a_val = |r: usize, i: usize| ((r * 13 + i * 5) % 9) as f32 - 4.0;
    let b_val = |i: usize| ((i * 3) % 5) as f32 - 2.0;
    let (k, n) = (8, 3);
    // (a_shard symmetric on every rank, or on rank 0 only; algorithm;
    // ag_out). The mismatch first: a rank that kept an agreed call
    // would not ask again.
    let runs = [
        (false, Algorithm::Pipelined, false),
        (true, Algorithm::Pipelined, false),
        (true, Algorithm::Pipelined, true),
        (true, Algorithm::Sequential, true),
    ];
    for world in [2, 3] {
        let groups = host_groups(world);
        for (shard, dim) in [(vec![6usize, k], 0usize), (vec![2, 3, k], 1)] {
            let rows = shard.iter().product::<usize>() / k;
            let mut gathered = shard.clone();
            gathered[dim] *= world;
            let mut out_shape = gathered.clone();
            *out_shape.last_mut().unwrap() = n;
            let got = on_each(&groups, |r, g| {
                let buf = Buffer::create(g, 4 * rows * k).unwrap();
                let h = rendezvous(&buf).unwrap();
                // SAFETY: the buffer holds rows * k f32.
                let mem = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut f32, rows * k) };
                mem.iter_mut().enumerate().for_each(|(i, v)| *v = a_val(r, i));
                let ordinary: Vec<f32> = (0..rows * k).map(|i| a_val(r, i)).collect();
                let b: Vec<f32> = (0..k * n).map(b_val).collect();
                let at = |addr: u64, shape: &[usize]| Array::contiguous(addr, DType::F32, shape);
                let mut results = Vec::new();
                for (everywhere, algorithm, with_ag) in runs {
                    let (mut out, mut ag) = (vec![f32::NAN; world * rows * n], vec![f32::NAN; world * rows * k]);
                    let a = match everywhere || r == 0 {
                        true => at(buf.addr(), &shard),
                        false => at(ordinary.as_ptr() as u64, &shard),
                    };
                    let call = AgMm {
                        a_shard: a,
                        bs: vec![at(b.as_ptr() as u64, &[k, n])],
                        gather_dim: dim as i64,
                        ag_out: with_ag.then(|| at(ag.as_mut_ptr() as u64, &gathered)),
                        outs: vec![at(out.as_mut_ptr() as u64, &out_shape)],
                        scales: AgMmScales::default(),
                        algorithm: Some(algorithm),
                    };
                    let res = fused_ag_mm(g, Ok(call), Stream(0)).map_err(|e| e.kind);
                    results.push((res, out, ag));
                }
                drop(h);
                results
            });
            let source = |g: usize| source_of(&shard, dim, world, g);
            let want: Vec<f32> = (0..world * rows * n)
                .map(|o| {
                    let (row, j) = (o / n, o % n);
                    (0..k)
                        .map(|h| {
                            let (owner, at) = source(row * k + h);
                            a_val(owner, at) * b_val(h * n + j)
                        })
                        .sum()
                })
                .collect();
            let want_ag: Vec<f32> = (0..world * rows * k).map(|e| a_val(source(e).0, source(e).1)).collect();
            for (r, results) in got.iter().enumerate() {
                for ((everywhere, algorithm, with_ag), (res, out, ag)) in runs.iter().zip(results) {
                    let what = format!("world {world} {shard:?} along {dim}, {algorithm:?}, rank {r}");
                    if !everywhere {
                        assert_eq!(*res, Err(ErrorKind::Mismatch), "{what}");
                        assert!(out.iter().all(|v| v.is_nan()), "{what}: written");
                        continue;
                    }
                    assert_eq!(*res, Ok(()), "{what}");
                    assert_eq!(out, &want, "{what}");
                    if *with_ag {
                        assert_eq!(ag, &want_ag, "{what}: ag_out");
                    }
                }
            }
            groups.iter().for_each(|g| g.release_scratch());
        }
    }
}

/// Pieces along the shard's first dimension, where the call gathers a
/// dimension before the last (dimension 0, or the sequence of a batch),
/// at most that length; never when gathering the last (K), nor in fp8.
#[test]
fn pieces_along_the_first_dimension() {
    let forced = |c: AgMm, pieces: usize| {
        let mut p = c.prepare(&host_facts(2), "host", false).unwrap();
        p.decision.pieces = pieces;
        p.pieces()
    };
    assert_eq!(forced(call(&[6, 8], 0, 8, &[3], &[12]), 4), 4);
    assert_eq!(forced(call(&[3, 5, 8], 0, 8, &[3], &[6, 5]), 4), 3);
    assert_eq!(forced(call(&[2, 3, 8], 1, 8, &[3], &[2, 6]), 4), 2);
    assert_eq!(forced(call(&[6, 8], 1, 16, &[3], &[6]), 4), 1);
    assert_eq!(forced(call(&[6, 8], 0, 8, &[3], &[12]), 1), 1);
    // The decision's own count follows the same rule (split_len).
    let p = call(&[2, 3, 8], 1, 8, &[3], &[2, 6]).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!(p.shape.split_len, 2);
    let p = call(&[6, 8], 1, 16, &[3], &[6]).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!(p.shape.split_len, 1);
    let p = call(&[5, 3, 8], 0, 8, &[3], &[10, 3]).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!(p.shape.split_len, 5);
}

#[test]
fn pieces_cover_the_length() {
    for (len, pieces) in [(7, 3), (2, 5), (9, 1), (0, 4), (16, 4)] {
        let runs: Vec<_> = piece_ranges(len, pieces).collect();
        assert_eq!(runs.len(), pieces.clamp(1, len.max(1)), "{len} in {pieces}");
        assert!(runs.iter().all(|&(_, n)| n > 0 || len == 0));
        let mut at = 0;
        for (from, n) in runs {
            assert_eq!(from, at);
            at += n;
        }
        assert_eq!(at, len);
    }
}

#[test]
fn gathered_shapes_for_each_dim() {
    // Leading dims: the gathered dim grows by the world size; K is kept.
    let p = call(&[2, 3, 4], 1, 4, &[5, 6], &[2, 9]).prepare(&host_facts(3), "host", false).unwrap();
    assert_eq!(p.dim, 1);
    // Workspace: three bf16 shards of 48 bytes, then bf16 scratch of 6 rows x 6.
    assert_eq!((p.shards, p.shard_bytes, p.gathered_k, p.scratch), (0, 48, None, 256));
    // Then the fused kernel's arrival flags, one u32 per rank (a shard
    // this small comes in one slice).
    assert_eq!((p.ready, p.slice_k, p.workspace), (512, 4, 512 + 3 * 4));
    // The last dim: K grows, so B has K * world rows and outputs keep the shard's rows.
    assert!(call(&[2, 3, 4], 2, 12, &[5], &[2, 3]).prepare(&host_facts(3), "host", false).is_ok());
    let e = call(&[2, 3, 4], 2, 4, &[5], &[2, 3]).prepare(&host_facts(3), "host", false).unwrap_err();
    assert_eq!(e.msg, "bs[0].shape[0] is 4; expected 12, a_shard's last dimension 4 times the world size 3");
    let e = call(&[2, 3, 4], 0, 4, &[5, 7], &[6, 4]).prepare(&host_facts(3), "host", false).unwrap_err();
    assert_eq!(e.msg, "outs[0].shape is [6, 4, 5]; expected [6, 3, 5]");
}

#[test]
fn ag_out_and_options() {
    let mut c = call(&[4, 8], 0, 8, &[3], &[8]);
    c.ag_out = Some(Array::contiguous(0x900_0000, DType::BF16, &[4, 8]));
    assert_eq!(
        c.clone().prepare(&host_facts(2), "host", false).unwrap_err().msg,
        "ag_out.shape is [4, 8]; expected [8, 8]"
    );
    c.ag_out = Some(Array::contiguous(0x900_0000, DType::BF16, &[8, 8]));
    assert!(c.clone().prepare(&host_facts(2), "host", false).is_ok());
    c.scales.a_scale = Some(Array::contiguous(0x900_1000, DType::F32, &[1]));
    let e = c.prepare(&host_facts(2), "host", false).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.msg.starts_with("opts->a_scale is set but a_shard is bf16"), "{}", e.msg);
}

#[test]
fn the_fused_gather_lies_slice_major() {
    // 256 x 8192 bf16 shards at world 2: 8 slices of 1024 columns, the
    // gathered A [8][512][1024].
    let p = call(&[256, 8192], 0, 8192, &[64], &[512]).prepare(&host_facts(2), "host", false).unwrap();
    let (base, el) = (0x4000_0000u64, 2u64);
    let plane = 512 * 1024 * el;
    // Rank 1's block of slice 3: its 256 rows after rank 0's, in plane 3.
    let b = p.slice_block(base, 3, 1, 256, 2, DType::BF16);
    assert_eq!((b.addr, b.shape.as_slice()), (base + 3 * plane + 256 * 1024 * el, &[256usize, 1024][..]));
    // A contiguous shard goes in one strided copy: element (i, s, j) of
    // the [256, 8, 1024] view is column s * 1024 + j of row i.
    let shard = Array::contiguous(0x9000_0000, DType::BF16, &[256, 8192]);
    let pairs = p.sliced(base, 1, 2, &shard);
    assert_eq!(pairs.len(), 1);
    let (g, t) = &pairs[0];
    assert_eq!((g.shape.as_slice(), g.strides.as_slice()), (&[256usize, 8, 1024][..], &[1024usize, 512 * 1024, 1][..]));
    assert_eq!((g.addr, t.addr, t.is_contiguous()), (base + 256 * 1024 * el, shard.addr, true));
    // A strided one (rows of a wider array) goes slice by slice, each
    // into its contiguous block.
    let wide = Array { strides: vec![9000, 1], ..shard };
    let pairs = p.sliced(base, 0, 2, &wide);
    assert_eq!(pairs.len(), 8);
    for (s, (g, t)) in pairs.iter().enumerate() {
        assert_eq!(
            (g.addr, g.is_contiguous(), g.shape.as_slice()),
            (base + s as u64 * plane, true, &[256usize, 1024][..])
        );
        assert_eq!((t.addr, t.strides.as_slice()), (wide.addr + (s * 1024) as u64 * el, &[9000usize, 1][..]));
    }
    // One slice: the row-major layout, rank r's shard at r * shard_bytes.
    let p = call(&[4, 96], 0, 96, &[8], &[8]).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!(p.slice_k, 96);
    let pairs = p.sliced(base, 1, 2, &Array::contiguous(0x9000_0000, DType::BF16, &[4, 96]));
    assert_eq!((pairs.len(), pairs[0].0.addr, pairs[0].0.is_contiguous()), (1, base + p.shard_bytes as u64, true));
}

/// An fp8 call: e4m3 shards `[rows, 32]`, column-major e4m3 Bs, bf16 outputs.
fn fp8_call(rows: usize, dim: i64, world: usize, ns: &[usize], row_wise: bool) -> AgMm {
    let mut c = call(&[rows, 32], dim, 32, ns, &[rows * world]);
    let k = if dim == 1 { 32 * world } else { 32 };
    c.a_shard.dtype = DType::F8E4M3;
    for (i, (b, &n)) in c.bs.iter_mut().zip(ns).enumerate() {
        *b = Array { addr: 0x200_0000 * (i as u64 + 1), dtype: DType::F8E5M2, shape: vec![k, n], strides: vec![1, k] };
    }
    if dim == 1 {
        c.outs.iter_mut().for_each(|o| o.shape[0] = rows);
    }
    let scale = |i: u64, shape: &[usize]| Array::contiguous(0x7000_0000 + 0x1000 * i, DType::F32, shape);
    c.scales = AgMmScales {
        a_scale: Some(scale(0, &if row_wise { vec![rows, 1] } else { vec![1] })),
        b_scales: Some(
            ns.iter()
                .enumerate()
                .map(|(i, &n)| scale(1 + i as u64, &if row_wise { vec![1, n] } else { vec![1] }))
                .collect(),
        ),
        biases: None,
        result_scales: None,
    };
    c
}

#[test]
fn fp8_plans() {
    // Row-wise: the gathered row scales get their own region after the shards.
    let p = fp8_call(8, 0, 2, &[16, 32], true).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!(p.mode, Some(Mode::Row));
    assert_eq!((p.shard_bytes, p.row_scales, p.scratch), (8 * 32, Some(512), 768));
    // Each rank's slot of row scales is 16-byte aligned (3 rows: 16 bytes).
    assert_eq!((row_scale_slot(3), row_scale_slot(8)), (16, 32));
    // Products in the (bf16) output type, not the 1-byte input type;
    // then the (unused) fused arrival flags; then room for each B's row
    // scales copied aligned (no bias). Regions start 256 bytes apart.
    let row_scales = |scale| BVectors { scale, bias: None };
    assert_eq!((p.ready, p.tensor_scale, p.b_vectors.clone()), (1280, None, vec![row_scales(1536), row_scales(1792)]));
    assert_eq!(p.workspace, 1792 + 32 * 4);
    // A large shard comes in slices, each with a flag: 8 of 1024 columns.
    let p = call(&[256, 8192], 0, 8192, &[64], &[512]).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!(p.slice_k, 1024);
    assert_eq!(p.workspace - p.ready, 2 * 8 * 4);
    let p = fp8_call(8, 0, 2, &[16], false).prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!((p.mode, p.row_scales), (Some(Mode::Tensor), None));
    // Gathering K: tensor-wise only.
    assert!(fp8_call(8, 1, 2, &[16], false).prepare(&host_facts(2), "host", false).is_ok());
    let e = fp8_call(8, 1, 2, &[16], true).prepare(&host_facts(2), "host", false).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unsupported);
    assert!(e.msg.starts_with("row-wise scales with gather_dim 1"), "{}", e.msg);
    // fp8 products go straight into outputs cuBLASLt's fp8 kernels can
    // write, others (one element off 16-byte alignment) through scratch.
    let p = fp8_call(8, 0, 2, &[16], false).prepare(&host_facts(2), "host", false).unwrap();
    let out = &p.call.outs[0];
    assert!(p.direct_output(out).is_some());
    let off = Array { addr: out.addr + 2, ..out.clone() };
    assert!(p.direct_output(&off).is_none());
    let bf16 = call(&[8, 32], 0, 32, &[16], &[16]).prepare(&host_facts(2), "host", false).unwrap();
    assert!(bf16.direct_output(&off).is_some(), "any row-major output without scales");
    // Scales are required, N must be a multiple of 16, outputs are not fp8.
    let mut c = fp8_call(8, 0, 2, &[16], false);
    c.scales.b_scales = None;
    assert!(c.prepare(&host_facts(2), "host", false).unwrap_err().msg.contains("set opts->b_scales"));
    assert!(fp8_call(8, 0, 2, &[24], false).prepare(&host_facts(2), "host", false).unwrap_err().msg.contains("N = 24"));
    // An fp8 output: an f32 product of the shard's rows (8 x 32) after
    // the scratch, before the flags; its result scale is one f32.
    let mut c = fp8_call(8, 0, 2, &[16, 32], true);
    c.outs[1].dtype = DType::F8E4M3;
    let p = c.clone().prepare(&host_facts(2), "host", false).unwrap();
    assert_eq!((p.scratch, p.wide, p.ready), (768, Some(768 + 8 * 32 * 2), 768 + 8 * 32 * 2 + 8 * 32 * 4));
    let scale = |shape: &[usize]| Some(Array::contiguous(0x7200_0000, DType::F32, shape));
    c.scales.result_scales = Some(vec![None, scale(&[1])]);
    assert!(c.clone().prepare(&host_facts(2), "host", false).is_ok());
    c.scales.result_scales = Some(vec![scale(&[1]), None]);
    let e = c.clone().prepare(&host_facts(2), "host", false).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.msg.starts_with("opts->result_scales[0] is set but outs[0] is bf16"), "{}", e.msg);
    c.scales.result_scales = Some(vec![None, scale(&[1, 2])]);
    assert!(c.prepare(&host_facts(2), "host", false).unwrap_err().msg.contains("expected one element"));
    // A bias of the output's type and width.
    let mut c = fp8_call(8, 0, 2, &[16, 32], true);
    let bias = |n| Some(Array::contiguous(0x7100_0000, DType::BF16, &[n]));
    c.scales.biases = Some(vec![None, bias(32)]);
    assert!(c.clone().prepare(&host_facts(2), "host", false).is_ok());
    c.scales.biases = Some(vec![bias(32), None]);
    assert_eq!(
        c.prepare(&host_facts(2), "host", false).unwrap_err().msg,
        "opts->biases[0].shape is [32]; expected [16]"
    );
}

#[test]
fn signature_holds_what_ranks_must_share_only() {
    let a = call(&[4, 8], 0, 8, &[3, 5], &[8]);
    let mut b = a.clone();
    b.a_shard.strides = vec![1, 4];
    b.a_shard.addr += 0x40;
    b.outs[0].strides = vec![1, 8];
    assert_eq!(a.signature(None), b.signature(None));
    b.gather_dim = 1;
    assert_ne!(a.signature(None), b.signature(None));
}
