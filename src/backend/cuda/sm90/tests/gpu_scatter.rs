//! On a GPU: the reduce-scatter epilogue (pushes, flags, epochs, narrow
//! peer tiles, adds into C), several ranks on one device.

use super::super::launch::*;
use super::super::matmul::*;
use super::super::tiling::*;
use super::gpu::*;
use crate::backend::cuda::async_error::AsyncError;
use crate::backend::cuda::gemm::{Fp8, GemmDtype};
use crate::backend::cuda::gpu_testing::{decode, encode as enc, gpu, rel_err, round_robin_ms, values, DevBuf, Gpu};
use crate::backend::cuda::streams::SideStreams;
use crate::backend::{CallTag, FusedMatmul, FusedScatter};

/// Reduce-scatter mode: `world` ranks simulated on one GPU, each kernel
/// on half the SMs / its own stream so they run concurrently; bf16, and
/// fp8 with row-wise scales and a bias (in every rank's product).
#[test]
fn gpu_sm90_matmul_reduce_scatter_epilogue() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    // Peers' tiles by TMA stores and own rows summed from partials loaded
    // into the ring (320-column rows: the last box of a tile past n; 192
    // rows: a tile's second warpgroup past its chunk; world 3: two peers'
    // partials added in turn; an f32 C: twice the boxes) and, for
    // comparison, all from registers. A share of the SMs per rank gives
    // each CTA about one tile; one CTA per rank walks them all, handing
    // tile after tile to its flagging warp; as many CTAs as a chunk has
    // tiles make each CTA's last pushed tile the one its peer's first own
    // tile waits for (v8, which took those flags before the tile's
    // mainloop but set its own last one after it, waited there until the
    // timeout). The sums go to C from the ring where they were added,
    // and in two cases through the staging area.
    use Ctas::*;
    let (bf16, f32) = (GemmDtype::BF16, GemmDtype::F32);
    let case = |world, fp8, out, push, ctas| RsCase { world, fp8, out, push, ctas, ..RsCase::default() };
    for c in [
        case(2, false, bf16, true, Share),
        case(2, true, bf16, true, Share),
        case(3, false, bf16, true, Share),
        case(2, false, f32, true, Share),
        case(2, false, bf16, true, One),
        case(3, false, bf16, true, One),
        case(2, false, bf16, true, ChunkTiles),
        case(3, false, f32, true, ChunkTiles),
        case(2, false, bf16, false, Share),
        case(2, true, bf16, false, Share),
        case(2, false, f32, false, ChunkTiles),
        // This rank's C where TMA cannot store it (the sums from registers).
        RsCase { misaligned_c: true, ..case(2, false, bf16, true, Share) },
        // Three peers' partials added in turn. (With an f32 C the sums
        // span several stages of the ring, each held until their stores
        // have read it.)
        case(4, false, f32, true, One),
    ] {
        reduce_scatter_case(&g, kern, c);
    }
    // A peer that never sends its partials: rank 0 alone gives up on them
    // and says who, with either way of sending.
    for push in [true, false] {
        reduce_scatter_case(&g, kern, RsCase { peer_missing: true, ..case(2, false, bf16, push, Share) });
    }
    // A peer in another call of the same shape (its tag): a mismatch, with
    // either way of sending, at worlds 2 and 3.
    for (world, push) in [(2, true), (2, false), (3, true)] {
        reduce_scatter_case(&g, kern, RsCase { out_of_step: true, ..case(world, false, bf16, push, Share) });
    }
}

/// Narrow peer tiles (`NarrowPeers`): the peers' chunks in tiles of 248
/// and 240 columns (n = 728: three of them, the first 248 wide) under own
/// tiles of 256 (the last one 216), so that each own tile sums the partials
/// of two narrow tiles, pushed by TMA boxes (each tile's last one shifted
/// back to overlap the one before); bf16 and
/// f32 C (whose boxes are half as wide), world 2 and 3, one CTA walking
/// every tile, misaligned C, and a missing peer; staggered widths (n = 720:
/// 248, 240 and 232); and with every rank's C passed as symmetric
/// (`FusedScatter::out`), where at world 2 the peer stores its partials into C
/// and the own tiles add theirs.
#[test]
fn gpu_sm90_reduce_scatter_narrow_peer_tiles() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    use Ctas::*;
    let (bf16, f32) = (GemmDtype::BF16, GemmDtype::F32);
    let case = |world, out, ctas| RsCase { world, out, ctas, narrow: true, ..RsCase::default() };
    for c in [
        case(2, bf16, Share),
        case(2, f32, Share),
        case(3, bf16, ChunkTiles),
        case(3, f32, One),
        case(2, bf16, One),
        RsCase { misaligned_c: true, ..case(2, bf16, Share) },
        RsCase { misaligned_c: true, ..case(3, f32, ChunkTiles) },
        RsCase { staggered: true, ..case(2, bf16, Share) },
        RsCase { staggered: true, ..case(3, f32, One) },
        RsCase { adds: true, ..case(2, bf16, Share) },
        RsCase { adds: true, ..case(2, f32, Share) },
        RsCase { adds: true, ..case(2, bf16, One) },
        RsCase { adds: true, staggered: true, ..case(2, bf16, Share) },
        RsCase { adds: true, staggered: true, ..case(2, f32, One) },
        // Into C, then through the inbox, then into C again, back to back.
        RsCase { adds: true, mixed: true, ..case(2, bf16, Share) },
        RsCase { adds: true, mixed: true, ..case(2, f32, One) },
        // Not at world 3, nor with a misaligned C: those push into inboxes.
        RsCase { adds: true, ..case(3, bf16, ChunkTiles) },
        RsCase { adds: true, misaligned_c: true, ..case(2, bf16, Share) },
    ] {
        reduce_scatter_case(&g, kern, c);
    }
    reduce_scatter_case(&g, kern, RsCase { peer_missing: true, ..case(2, bf16, Share) });
    reduce_scatter_case(&g, kern, RsCase { peer_missing: true, adds: true, ..case(2, bf16, Share) });
    // Another call's tag with narrow peer tiles, into the inbox and into C.
    reduce_scatter_case(&g, kern, RsCase { out_of_step: true, ..case(2, bf16, Share) });
    reduce_scatter_case(&g, kern, RsCase { out_of_step: true, adds: true, ..case(2, bf16, Share) });
}

/// One reduce-scatter case of [`reduce_scatter_case`].
#[derive(Clone, Copy, Debug)]
struct RsCase {
    world: usize,
    fp8: bool,
    out: GemmDtype,
    /// rs_push (TMA), else from registers.
    push: bool,
    ctas: Ctas,
    /// Narrow peer tiles (n 728, see gpu_sm90_reduce_scatter_narrow_peer_tiles).
    narrow: bool,
    /// With narrow tiles: of three widths (n 720).
    staggered: bool,
    /// Each rank's C one element past a 16-byte boundary.
    misaligned_c: bool,
    /// Only rank 0 runs (see reduce_scatter_case).
    peer_missing: bool,
    /// The last rank's second call is another call (its tag; see
    /// reduce_scatter_case).
    out_of_step: bool,
    /// Every rank's C given as symmetric (`FusedScatter::out`): the partials go
    /// through it where `Sm90Matmul::rs_adds` allows.
    adds: bool,
    /// With `adds`: the second call into ordinary memory (its partials
    /// through the inbox), between two calls adding into C.
    mixed: bool,
}

impl Default for RsCase {
    fn default() -> Self {
        RsCase {
            world: 2,
            fp8: false,
            out: GemmDtype::BF16,
            push: true,
            ctas: Ctas::Share,
            narrow: false,
            staggered: false,
            misaligned_c: false,
            peer_missing: false,
            out_of_step: false,
            adds: false,
            mixed: false,
        }
    }
}

/// CTAs per rank in a reduce-scatter case.
#[derive(Clone, Copy, Debug)]
enum Ctas {
    /// The SMs split evenly between the ranks.
    Share,
    One,
    /// As many as a chunk has tiles.
    ChunkTiles,
}

/// Each rank runs `CALLS` calls back to back on its own stream, each into
/// its own poisoned output, with nothing between them: the kernels' count
/// of calls (the state's epoch) alone keeps a call's pushes out of an inbox
/// the previous call still reads. Each call has a tag of its own (the same
/// on every rank), so a tag another call left in the state is never taken
/// for a mismatch. With `peer_missing`, only rank 0 runs, once (200 ms
/// timeout): a timeout error naming rank 1 is expected instead of the
/// sums. With `out_of_step`, the last rank's second call carries another
/// call's tag (ranks out of step between two kept calls of one shape): a
/// mismatch is expected, before the 5 s timeout.
fn reduce_scatter_case(g: &Gpu, kern: &Sm90Kernels, case: RsCase) {
    let RsCase { world, fp8, out, push, ctas, narrow, staggered, misaligned_c, peer_missing, out_of_step, adds, mixed } =
        case;
    let dt = GemmDtype::BF16;
    let n = match (narrow, staggered) {
        (false, _) => 320,
        (true, false) => 728,
        (true, true) => 720,
    };
    let (rows, k) = (192usize, 128usize);
    // The first of the narrow tiles 248 columns wide, the other two 240;
    // staggered, 248, 240 and 232.
    let narrow_tiles = NarrowPeers { tiles: 3, width: 240, narrower: usize::from(staggered) };
    let m = world * rows;
    let ps: Vec<Problem> = (0..world)
        .map(|r| {
            let seed = 40 + 2 * r as u64;
            if fp8 {
                fp8_problem(g, m, n, k, (Fp8::E5M2, Fp8::E4M3), seed)
            } else {
                problem(g, m, n, k, dt, seed)
            }
        })
        .collect();
    let scales: Vec<Scales> = (0..world).map(|_| Scales::new(g, m, n, true, Some(dt))).collect();
    let errors = AsyncError::new().unwrap();
    let template = |r: usize, c: u64| {
        let mut mm = Sm90Matmul::plain(
            Operand { ptr: ps[r].bufs[0].ptr, rows: m, ld: k },
            Operand { ptr: ps[r].bufs[1].ptr, rows: n, ld: k },
            Operand { ptr: c, rows, ld: n },
            k,
            dt,
            errors.device_ptr(),
        );
        mm.chunk_rows = rows;
        mm.order = (1..=world).map(|i| (r + i) % world).collect();
        mm.out_dtype = out;
        mm.alpha = 0.5;
        mm.max_ctas = Some(match ctas {
            Ctas::Share => g.kernels.sm_count / world as u32,
            Ctas::One => 1,
            Ctas::ChunkTiles => mm.tiles_per_chunk() as u32,
        });
        mm.timeout_ns = if peer_missing { 200_000_000 } else { 5_000_000_000 };
        mm.rs_push = push;
        if fp8 {
            mm.set_fp8(scales[r].params(Fp8::E5M2, Fp8::E4M3));
        }
        if narrow {
            (mm.tile, mm.rs_narrow) = (TileN::N256, Some(narrow_tiles));
        }
        mm
    };
    const CALLS: usize = 3;
    // With a (placeholder) scatter, so that it counts the narrow tiles' flags.
    let (skew, out_elem) = (usize::from(misaligned_c), out.size());
    let probe = Sm90Matmul {
        scatter: Some(FusedScatter {
            rank: 0,
            inbox: vec![0; world],
            state: vec![0; world],
            out: None,
            tag: CallTag::of(b"probe"),
        }),
        ..template(0, 0)
    };
    assert_eq!(probe.narrow().is_some(), narrow && push, "{case:?}");
    // Whether the partials go through C: world 2, narrow tiles, an aligned C.
    let c_at = (skew * out_elem) as u64;
    let mut with_outs = probe.clone();
    with_outs.c.ptr = c_at;
    with_outs.scatter.as_mut().unwrap().out = adds.then(|| vec![c_at; world]);
    let adding = with_outs.rs_adds();
    assert_eq!(adding, adds && world == 2 && narrow && push && !misaligned_c, "{case:?}");
    let inboxes: Vec<DevBuf> = (0..world).map(|_| poisoned(g, probe.inbox_bytes() / out.size(), out)).collect();
    let states: Vec<DevBuf> = (0..world).map(|_| g.upload(&vec![0u8; probe.state_bytes()])).collect();
    let calls = if peer_missing { 1 } else { CALLS };
    let outs: Vec<Vec<DevBuf>> =
        (0..calls).map(|_| (0..world).map(|_| poisoned(g, rows * n + skew, out)).collect()).collect();
    let sides = SideStreams::default();
    let launched = if peer_missing { 1 } else { world };
    let tag = |call: usize, r: usize| match out_of_step && call == 1 && r == world - 1 {
        true => CallTag::of(b"another call"),
        false => CallTag::of(format!("call {call}").as_bytes()),
    };
    for (call, call_outs) in outs.iter().enumerate() {
        let into_c = adds && !(mixed && call % 2 == 1);
        for (r, out) in call_outs.iter().enumerate().take(launched) {
            let mut mm = template(r, out.ptr + c_at);
            mm.scatter = Some(FusedScatter {
                rank: r,
                inbox: inboxes.iter().map(|b| b.ptr).collect(),
                state: states.iter().map(|b| b.ptr).collect(),
                out: into_c.then(|| call_outs.iter().map(|o| o.ptr + c_at).collect()),
                tag: tag(call, r),
            });
            assert_eq!(mm.rs_adds(), adding && into_c);
            mm.launch(kern, g.kernels.sm_count, sides.stream(r).unwrap()).unwrap();
        }
    }
    for r in 0..launched {
        sides.wait(g.stream(), sides.stream(r).unwrap()).unwrap();
    }
    g.sync();
    if peer_missing {
        let e = errors.check().unwrap_err();
        assert!(e.msg.contains("fused matmul waiting for rank 1"), "{case:?}: {}", e.msg);
        return;
    }
    if out_of_step {
        // Either side may record first: the last rank found a peer's tag,
        // or a peer found the last rank's; found, not waited out (only the
        // first failure is recorded, and no flag was missing).
        let e = errors.check().unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "{case:?}: {}", e.msg);
        assert!(e.msg.contains("fused matmul waiting for rank"), "{case:?}: {}", e.msg);
        return;
    }
    errors.check().unwrap();
    let out_dtype = out;
    for (call, (r, out)) in outs.iter().enumerate().flat_map(|(c, o)| o.iter().enumerate().map(move |x| (c, x))) {
        let rows_r = r * rows..(r + 1) * rows;
        let want: Vec<f64> = {
            let parts: Vec<Vec<f64>> = ps.iter().map(|p| p.reference(rows_r.clone())).collect();
            let term = |q: usize, e: usize| {
                let (i, j) = (r * rows + e / n, e % n);
                if fp8 {
                    scales[q].apply(i, j, parts[q][e])
                } else {
                    parts[q][e]
                }
            };
            (0..rows * n).map(|e| 0.5 * (0..world).map(|q| term(q, e)).sum::<f64>()).collect()
        };
        let got = decode(out_dtype, &out.read_bytes());
        let e = rel_err(&got[skew..skew + rows * n], &want);
        assert!(e < 1e-2, "{case:?}, rank {r}, call {call}: relative error {e}");
    }
    // Each rank counted every call (and, through C, started the last one),
    // each peer stored the last two calls' tags there (by the epoch's
    // parity), and each peer's flag of each of its tiles holds the epoch of
    // the last one (a rank never flags itself).
    for (r, state) in states.iter().enumerate() {
        let words = state.read::<u32>(probe.state_bytes() / 4);
        let header = FusedMatmul::STATE_HEADER_BYTES / 4;
        assert_eq!(words[0], CALLS as u32, "rank {r}'s epoch");
        assert_eq!(words[2], if adding { CALLS as u32 } else { 0 }, "rank {r}'s calls started");
        assert_eq!(words[1], 0, "rank {r}'s count of finished CTAs is reset");
        for (call, src) in (CALLS - 2..CALLS).flat_map(|c| (0..world).map(move |s| (c, s))) {
            // Call c has epoch c + 1.
            let slot = 3 + (call + 1) % 2 * super::super::MAX_CHUNKS + src;
            let want = if src == r { 0 } else { tag(call, src).get() };
            assert_eq!(words[slot], want, "rank {r}'s tag from rank {src} in call {call}");
        }
        for (i, &f) in words[header..].iter().enumerate() {
            let src = i / probe.tiles_per_chunk();
            assert_eq!(f, if src == r { 0 } else { CALLS as u32 }, "rank {r}, flag {i} (from rank {src})");
        }
    }
}

/// The reduce-scatter epilogue's two ways, timed on one GPU: two ranks in
/// one context, each kernel on half the SMs and its own stream, their
/// "peer" inboxes local memory. NVLink is absent, so this shows what the
/// consumers spend on the reduce-scatter itself (stores, fence, flag and
/// adds per tile from registers, against TMA stores, a flagging warp and
/// partials loaded into the ring), not the link; the two-GPU benchmark
/// times the real thing. The same two
/// matmuls without the reduce-scatter (each rank's whole product into its
/// own buffer) are the floor: what the epilogue costs beyond a plain one.
#[test]
fn gpu_sm90_reduce_scatter_push_against_registers() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    // The benchmark's mm_rs 16384x4096x8192 and 512x14336x8192, halved
    // (each rank has half the SMs); SYMM_SM90_SHAPE picks one.
    for (rows, n, k) in [(4096usize, 8192usize, 4096usize), (256, 8192, 14336)] {
        if shape_selected(2 * rows, n, k) {
            rs_push_against_registers(&g, kern, rows, n, k);
        }
    }
}

fn rs_push_against_registers(g: &Gpu, kern: &Sm90Kernels, rows: usize, n: usize, k: usize) {
    let dt = GemmDtype::BF16;
    let world = 2usize;
    let m = world * rows;
    let p = g.upload(&enc(dt, &values(m * k, 5)));
    let w = g.upload(&enc(dt, &values(n * k, 6)));
    let errors = AsyncError::new().unwrap();
    let outs: Vec<DevBuf> = (0..world).map(|_| g.alloc(rows * n * 2)).collect();
    let mut mms = Vec::new();
    for (r, out) in outs.iter().enumerate() {
        let mut mm = Sm90Matmul::plain(
            Operand { ptr: p.ptr, rows: m, ld: k },
            Operand { ptr: w.ptr, rows: n, ld: k },
            Operand { ptr: out.ptr, rows, ld: n },
            k,
            dt,
            errors.device_ptr(),
        );
        mm.chunk_rows = rows;
        mm.order = (1..=world).map(|i| (r + i) % world).collect();
        mm.max_ctas = Some(g.kernels.sm_count / world as u32);
        mm.timeout_ns = 5_000_000_000;
        mms.push(mm);
    }
    let inboxes: Vec<DevBuf> = (0..world).map(|_| g.alloc(mms[0].inbox_bytes())).collect();
    let states: Vec<DevBuf> = (0..world).map(|_| g.upload(&vec![0u8; mms[0].state_bytes()])).collect();
    for (r, mm) in mms.iter_mut().enumerate() {
        mm.scatter = Some(FusedScatter {
            rank: r,
            inbox: inboxes.iter().map(|b| b.ptr).collect(),
            state: states.iter().map(|b| b.ptr).collect(),
            out: None,
            tag: CallTag::of(b"rs"),
        });
    }
    let sides = SideStreams::default();
    let (main, side) = (g.stream(), sides.stream(0).unwrap());
    // The floor: no scatter, each rank's m x n product into its own buffer.
    let products: Vec<DevBuf> = (0..world).map(|_| g.alloc(m * n * 2)).collect();
    let plain: Vec<Sm90Matmul> = mms
        .iter()
        .zip(&products)
        .map(|(mm, out)| Sm90Matmul {
            c: Operand { ptr: out.ptr, rows: m, ld: n },
            chunk_rows: m,
            order: vec![0],
            scatter: None,
            ..mm.clone()
        })
        .collect();
    // Candidate c: 0 = from registers, 1 = pushed, 2 = no scatter; both ranks at once.
    let med = round_robin_ms(g, 3, |c| {
        let mut pair = if c == 2 { plain.clone() } else { mms.clone() };
        for mm in &mut pair {
            mm.rs_push = c == 1;
        }
        sides.wait(side, main).unwrap();
        pair[0].launch(kern, g.kernels.sm_count, main).unwrap();
        pair[1].launch(kern, g.kernels.sm_count, side).unwrap();
        sides.wait(main, side).unwrap();
    });
    g.sync();
    errors.check().unwrap();
    // The pushed results at full size, where each CTA hands many tiles to
    // its flagging warp: both ranks multiply the same matrices, so rank r's
    // rows are twice its rows of the floor's product (poisoned first).
    let checked: Vec<DevBuf> = (0..world).map(|_| poisoned(g, rows * n, dt)).collect();
    let mut pair: Vec<Sm90Matmul> = mms.clone();
    for (mm, out) in pair.iter_mut().zip(&checked) {
        mm.rs_push = true;
        mm.c.ptr = out.ptr;
    }
    sides.wait(side, main).unwrap();
    pair[0].launch(kern, g.kernels.sm_count, main).unwrap();
    pair[1].launch(kern, g.kernels.sm_count, side).unwrap();
    sides.wait(main, side).unwrap();
    g.sync();
    errors.check().unwrap();
    let product = decode(dt, &products[0].read_bytes());
    for (r, out) in checked.iter().enumerate() {
        let want: Vec<f64> = product[r * rows * n..(r + 1) * rows * n].iter().map(|&x| 2.0 * x as f64).collect();
        let e = rel_err(&decode(dt, &out.read_bytes()), &want);
        assert!(e < 1e-2, "pushed reduce-scatter at full size, rank {r}: relative error {e}");
    }
    for (imp, ms) in ["symm_sm90_rs_registers", "symm_sm90_rs_push", "symm_sm90_no_scatter"].iter().zip(&med) {
        print_record((m, k, n), "bf16_rs_world2_one_gpu", imp, *ms);
    }
    println!(
        "sm90 reduce-scatter on one GPU, {m}x{k}x{n}, world 2: pushed / from registers {:.3}, from registers / \
         no scatter {:.3}, pushed / no scatter {:.3}",
        med[1] / med[0],
        med[0] / med[2],
        med[1] / med[2]
    );
    // Both ranks counted the same calls (both ways alike), and every peer
    // tile's flag holds the last one's epoch.
    let words: Vec<Vec<u32>> = states.iter().map(|s| s.read::<u32>(mms[0].state_bytes() / 4)).collect();
    let epoch = words[0][0];
    assert!(epoch > 1 && words[1][0] == epoch, "epochs {} and {}", words[0][0], words[1][0]);
    let header = FusedMatmul::STATE_HEADER_BYTES / 4;
    for (r, w) in words.iter().enumerate() {
        for (i, &f) in w[header..].iter().enumerate() {
            let src = i / mms[0].tiles_per_chunk();
            assert_eq!(f, if src == r { 0 } else { epoch }, "rank {r}, flag {i}");
        }
    }
}
