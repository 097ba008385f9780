//! The cost model: for a fused operation on a given group and shape, the
//! predicted matmul time, communication time and exposed (not hidden)
//! communication of each algorithm, and the best of them ([`best`]).
//! The operations' choice (`ops::decide`) and the C query `symm_plan_*`
//! both go by it.
//!
//! Times come from a roofline of the device (matmul rate, copy-engine link
//! bandwidth, HBM bandwidth, launch and barrier latencies) plus the cost of
//! splitting a matmul into pieces, calibrated on measured runs
//! (`bench/results/`): with per-rank pieces in rank-staggered order,
//! splitting costs about 1%.

/// What the device can do, in the units the model uses.
#[derive(Clone, Copy, Debug)]
pub struct DeviceModel {
    /// Dense bf16/f16 matmul rate on large problems, TFLOP/s.
    pub matmul_tflops: f64,
    /// The same for fp8 (1-byte) operands.
    pub fp8_matmul_tflops: f64,
    /// Copy-engine pull bandwidth from one peer, GB/s.
    pub link_gbps: f64,
    /// The same while the SMs run a matmul beside it: what the timeline of
    /// [`scatter_pieces`] pulls at. ([`gather_pieces`] pulls at
    /// `link_gbps`: at this rate it chose 4 pieces for ag_mm
    /// 12000x4096x1536, measured 4% slower than the 2 it takes at that one.)
    pub loaded_link_gbps: f64,
    /// Device memory bandwidth, GB/s (reads + writes).
    pub hbm_gbps: f64,
    /// Fixed cost of one kernel or copy launch in a pipeline, microseconds.
    pub launch_us: f64,
    /// How much later than a barrier the pipelined all-gather's staged
    /// shards start to land, microseconds: the shard's copy into the
    /// workspace, then the copy engine starting after the SMs and the next
    /// matmul after the copy engine ([`STAGED_SHARD_BYTES`]).
    pub staged_pull_start_us: f64,
    /// One barrier or signal round trip between ranks, microseconds.
    pub barrier_us: f64,
    /// Relative matmul slowdown for each extra piece a matmul is split into.
    pub split_penalty: f64,
    /// Time of symm's own fused matmul relative to cuBLAS on the whole
    /// problem. The fused algorithm is chosen by measurement, not by this
    /// estimate (see [`best`]).
    pub fused_slowdown: f64,
}

impl DeviceModel {
    /// Hopper (H100/H200 SXM) with NVLink, measured on 2 x H200.
    pub const HOPPER: DeviceModel = DeviceModel {
        matmul_tflops: 790.0,
        // cuBLASLt, e4m3, 16384 x 8192 x 8192 in 1.653 ms on one H200.
        fp8_matmul_tflops: 1330.0,
        link_gbps: 358.0,
        // mm_rs 4096x2048x8192 pipelined with the peer's chunk whole,
        // graph-replayed on 2 x H200 (0.273 ms): its 33.5 MB pulled in about
        // 0.147 ms beside this rank's pieces of matmul.
        loaded_link_gbps: 230.0,
        hbm_gbps: 4300.0,
        launch_us: 6.0,
        // Graph-replayed on 2 x H200, the pulled ag_mm 538x3072x7392,
        // 578x7168x2240 and 780x4096x1280 exposed 10-20 us where a barrier
        // each side and the pull's excess over the own shard's matmul
        // (measured, bench/results/2026-12-01-h200-bcd3b9d-world1) came
        // to 8: 15.5-19.7 us more.
        staged_pull_start_us: 17.0,
        barrier_us: 4.0,
        split_penalty: 0.01,
        fused_slowdown: 1.04,
    };
}

/// The all-reduce's share of the model: kernel latencies of its two
/// algorithms (the whole call, graph-replayed) at a tiny message, growing
/// with the peers each rank signals and polls, and the bandwidth its stores
/// reach over the links. Calibrated on 4 KB-8 MB at worlds 2 and 4 on H200s
/// (`bench_allreduce.py`'s forced rows, 2026-11-28): one-shot 5.0 / 7.4 us,
/// two-shot 10.9 / 14.6 us at 4 KB, crossing near 2 MB and 700 KB.
#[derive(Clone, Copy, Debug)]
pub struct AllReduceModel {
    /// One-shot at a tiny message over one peer, microseconds (one launch,
    /// one trip).
    pub one_shot_us: f64,
    /// Two-shot at a tiny message over one peer, microseconds (two trips).
    pub two_shot_us: f64,
    /// Each further peer's cost at a tiny message, one-shot and two-shot.
    pub one_shot_per_peer_us: f64,
    pub two_shot_per_peer_us: f64,
    /// Peer store bandwidth of the SM copies, GB/s per rank.
    pub push_gbps: f64,
    /// The reduce-scatter by pieces after a matmul at a tiny chunk over one
    /// peer, microseconds (one trip, and the ranks' matmuls ending apart),
    /// and its rate, GB/s per rank: its kernel took 7.0-7.5 us at 128 KiB
    /// chunks, 10 at 512 KiB, 11-11.5 at 1 MiB and 15-18.5 at 2 MiB after
    /// mm_rs's matmul, graph-replayed on 2 x H200
    /// (bench/results/2026-11-30-h200-x2-2178cf1-scatter-pieces). That
    /// kernel still fenced before its flags; without the fence it is
    /// 1-1.6 us faster (...-ef80067-pieces-no-fence), which this estimate
    /// does not yet count.
    pub scatter_pieces_us: f64,
    pub scatter_pieces_gbps: f64,
}

impl AllReduceModel {
    pub const HOPPER: AllReduceModel = AllReduceModel {
        one_shot_us: 5.0,
        two_shot_us: 10.5,
        one_shot_per_peer_us: 1.2,
        two_shot_per_peer_us: 2.1,
        push_gbps: 360.0,
        scatter_pieces_us: 7.0,
        scatter_pieces_gbps: 250.0,
    };
}

/// The predicted time (ms) of an all-reduce of `bytes` per rank over
/// `world` ranks by each algorithm: (one-shot, two-shot). The one-shot
/// pushes the whole message to every peer as LL lines (twice its bytes);
/// the two-shot pushes `1/world` of it to each peer twice, and copies the
/// gathered slices out of its scratch.
pub fn all_reduce(bytes: usize, world: usize, m: &AllReduceModel, d: &DeviceModel) -> (f64, f64) {
    let (b, peers) = (bytes as f64, world.saturating_sub(1) as f64);
    let link = m.push_gbps * 1e6; // bytes per ms
    let more = (peers - 1.0).max(0.0);
    let one = (m.one_shot_us + more * m.one_shot_per_peer_us) / 1e3 + 2.0 * b * peers / link;
    let two = (m.two_shot_us + more * m.two_shot_per_peer_us) / 1e3
        + 2.0 * b * peers / world as f64 / link
        + b / (d.hbm_gbps * 1e6);
    (one, two)
}

/// `lc_allgather`'s share of the model: its copy-engine path's fixed cost
/// (graph-replayed, measured on 2 x H200: 25.6 us at 128 KiB per rank,
/// against NCCL's 9.4 us) and its LL path's (the one-shot all-reduce's
/// kernel placing lines instead of summing them: one launch, one trip, no
/// barrier).
#[derive(Clone, Copy, Debug)]
pub struct GatherModel {
    /// Copy engines at a tiny message over two ranks, microseconds: two
    /// barriers, the own part's copy and one pull.
    pub copies_us: f64,
    /// Each further peer's pull, microseconds (the pulls run one after
    /// another on one stream).
    pub copy_per_peer_us: f64,
    /// The LL kernel at a tiny message, microseconds.
    pub lines_us: f64,
    /// Peer store bandwidth of the LL lines, GB/s per rank (the lines carry
    /// twice the data's bytes).
    pub lines_gbps: f64,
}

impl GatherModel {
    pub const HOPPER: GatherModel =
        GatherModel { copies_us: 25.0, copy_per_peer_us: 3.0, lines_us: 4.0, lines_gbps: 300.0 };
    /// The LL reduce-scatter after a matmul (`mm_rs` at decode sizes):
    /// graph-replayed on 2 x H200 it took 8.9 us beyond the matmul at
    /// 128 KiB chunks and 18 us at 512 KiB
    /// (bench/results/2026-11-28-h200-x2-3b5d9be-decode), the rate a
    /// quarter of the gather's: the ranks' matmuls end apart, and the lines
    /// wait for the later one.
    pub const HOPPER_SCATTER: GatherModel = GatherModel { lines_gbps: 70.0, ..GatherModel::HOPPER };
}

/// The predicted time (ms) of `lc_allgather` of `bytes` per rank over
/// `world` ranks by each path: (copy engines, LL lines). The copy engines
/// pull each peer's part in turn at the link's rate after a fixed cost of
/// barriers and launches; the LL kernel pushes twice the message to every
/// peer with the SMs, after a kernel's latency. The fixed costs part them:
/// the lines win on small messages, the copy engines on large ones.
pub fn lc_allgather(bytes: usize, world: usize, m: &GatherModel, d: &DeviceModel) -> (f64, f64) {
    let (b, peers) = (bytes as f64, world.saturating_sub(1) as f64);
    let fixed = m.copies_us + m.copy_per_peer_us * (peers - 1.0).max(0.0);
    let copies = fixed / 1e3 + peers * transfer_ms(b, d);
    let lines = m.lines_us / 1e3 + 2.0 * b * peers / (m.lines_gbps * 1e6);
    (copies, lines)
}

/// The predicted time (ms) of the LL reduce-scatter of `bytes` per chunk
/// over `world` ranks (each rank pushes its chunk for every peer, as the
/// gather pushes its message).
pub fn reduce_scatter_lines(bytes: usize, world: usize, d: &DeviceModel) -> f64 {
    lc_allgather(bytes, world, &GatherModel::HOPPER_SCATTER, d).1
}

/// The predicted time (ms) of the device-side reduce-scatter by pieces
/// (the two-shot all-reduce's first trip: plain stores of each chunk to
/// its rank, a flag per piece; half the lines' bytes): the
/// fixed cost, growing with the peers as the one-shot's, then the stores'
/// rate.
pub fn reduce_scatter_pieces(bytes: usize, world: usize, m: &AllReduceModel) -> f64 {
    let (b, peers) = (bytes as f64, world.saturating_sub(1) as f64);
    let fixed = m.scatter_pieces_us + (peers - 1.0).max(0.0) * m.one_shot_per_peer_us;
    fixed / 1e3 + b * peers / (m.scatter_pieces_gbps * 1e6)
}

/// The predicted time (ms) of the device-side all-gather by pieces of
/// `bytes` per rank over `world` ranks: the reduce-scatter by pieces'
/// stores and flags, placed instead of summed. Its calibration fits:
/// graph-replayed on 2 x H200 the gather took 22 us at 4 MiB per rank
/// (predicted 23.8; the LL lines 30.5) and 15 us at 2 MiB after a matmul
/// (bench/results/2026-11-30-h200-x2-a8b7144-gather-pieces).
pub fn all_gather_pieces(bytes: usize, world: usize, m: &AllReduceModel) -> f64 {
    reduce_scatter_pieces(bytes, world, m)
}

/// NCCL's collectives between the GPUs of one host (NVLink), which the
/// level inside a host of the operations across hosts takes where the LL
/// lines do not pay: a fixed cost, growing with the peers, then the
/// links' rate. The fixed cost is its all-gather's of 128 KiB per rank on
/// two H200s, graph-replayed (9.4 us; see [`GatherModel`]).
#[derive(Clone, Copy, Debug)]
pub struct NcclModel {
    pub fixed_us: f64,
    pub per_peer_us: f64,
    /// Bytes each rank moves to or from each peer per second, GB/s.
    pub gbps: f64,
}

impl NcclModel {
    pub const HOPPER: NcclModel = NcclModel { fixed_us: 9.0, per_peer_us: 1.0, gbps: 358.0 };
}

/// The predicted time (ms) of NCCL's all-gather or reduce-scatter of
/// `bytes` per rank (per piece, per chunk) over `world` ranks of one host.
pub fn nccl_inside(bytes: usize, world: usize, m: &NcclModel) -> f64 {
    let peers = world.saturating_sub(1) as f64;
    (m.fixed_us + m.per_peer_us * (peers - 1.0).max(0.0)) / 1e3 + bytes as f64 * peers / (m.gbps * 1e6)
}

/// How an operation is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Communicate everything, then one matmul (or matmul, then reduce).
    Sequential,
    /// One matmul piece per rank's chunk, the communication of the next
    /// chunk overlapping the matmul of the current one.
    Pipelined,
    /// One persistent matmul kernel over the whole problem whose tiles wait
    /// for their rows (all-gather) or push their results (reduce-scatter).
    Fused,
}

impl Algorithm {
    pub const ALL: [Algorithm; 3] = [Algorithm::Sequential, Algorithm::Pipelined, Algorithm::Fused];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sequential => "sequential",
            Algorithm::Pipelined => "pipelined",
            Algorithm::Fused => "fused",
        }
    }

    /// The algorithm named `name` (as [`Algorithm::name`] writes it).
    pub fn parse(name: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.name() == name.trim().to_ascii_lowercase())
    }
}

/// The prediction for one algorithm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub algorithm: Algorithm,
    /// Matmul time, including what splitting costs (ms).
    pub compute_ms: f64,
    /// Communication time if it ran alone (ms).
    pub comm_ms: f64,
    /// Communication not hidden behind the matmul (ms).
    pub exposed_ms: f64,
    /// Predicted time of the whole operation (ms).
    pub total_ms: f64,
    /// Pipelined all-gather: the pieces each peer's shard is pulled and
    /// multiplied in ([`ag_mm`]); pipelined reduce-scatter: the pieces the
    /// peer's chunk is computed and announced in ([`mm_rs`]); 1 elsewhere.
    pub pieces: usize,
}

/// Shape of a fused operation as the model sees it.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// Rows of the whole matmul (all ranks' rows for all-gather + matmul;
    /// this rank's rows of A for matmul + reduce-scatter).
    pub m: usize,
    pub k: usize,
    /// Sum of the N of every B.
    pub n: usize,
    pub world: usize,
    /// Bytes per element of A and B.
    pub elem_bytes: usize,
    /// Bytes per element of the product (for an mm_rs, what the ranks
    /// exchange: an fp8 matmul's bf16 or f32 partials).
    pub out_bytes: usize,
    /// Whether the fused kernel can run this problem on every rank.
    pub fused: bool,
    /// All-gather: where the pipelined path may pull each shard in pieces
    /// along its first dimension, that dimension's length. Reduce-scatter:
    /// where the two-rank pipelined path multiplies its own chunk in pieces
    /// onto the pulled partials, their number. 1 elsewhere.
    pub split_len: usize,
}

fn matmul_ms(p: &Problem, rows: usize, d: &DeviceModel) -> f64 {
    let flops = 2.0 * rows as f64 * p.k as f64 * p.n as f64;
    let bytes = ((rows * p.k + p.k * p.n) * p.elem_bytes + rows * p.n * p.out_bytes) as f64;
    let tflops = if p.elem_bytes == 1 { d.fp8_matmul_tflops } else { d.matmul_tflops };
    (flops / (tflops * 1e9)).max(bytes / (d.hbm_gbps * 1e6)) + d.launch_us / 1e3
}

/// The matmul of `p.m` rows split into one piece of `p.m / world` rows per
/// rank: (all pieces, one piece). Each piece reads all of B, so where the
/// matmul is bound by that read (small M) the pieces cost about `world`
/// times the whole.
fn split_ms(p: &Problem, d: &DeviceModel) -> (f64, f64) {
    let piece = matmul_ms(p, p.m.div_ceil(p.world.max(1)), d) * (1.0 + d.split_penalty * (p.world as f64 - 1.0));
    (piece * p.world as f64, piece)
}

fn transfer_ms(bytes: f64, d: &DeviceModel) -> f64 {
    bytes / (d.link_gbps * 1e6)
}

/// A pull beside a running matmul.
fn loaded_transfer_ms(bytes: f64, d: &DeviceModel) -> f64 {
    bytes / (d.loaded_link_gbps * 1e6)
}

/// Both algorithms of an operation whose communication is `pulls`
/// transfers of `bytes` each (one after another) around the matmul of `p`
/// taking `whole` ms; `local_ms` is work the pipelined form adds after the
/// last piece (a local reduction); `first_pull_late_ms`, how much later
/// than the barrier the pipelined form's first pull starts.
fn estimates(
    p: &Problem,
    whole: f64,
    bytes: f64,
    local_ms: f64,
    first_pull_late_ms: f64,
    d: &DeviceModel,
) -> Vec<Estimate> {
    let (world, fused) = (p.world, p.fused);
    let pulls = world.saturating_sub(1) as f64;
    let barriers = 2.0 * d.barrier_us / 1e3;
    let comm = pulls * transfer_ms(bytes, d) + barriers;
    let mut out = vec![Estimate {
        algorithm: Algorithm::Sequential,
        compute_ms: whole,
        comm_ms: comm,
        exposed_ms: comm,
        total_ms: whole + comm,
        pieces: 1,
    }];
    if world > 1 {
        // Each pull hides behind a matmul piece; only the barriers (and the
        // local work) stay exposed, unless a pull (the first starting
        // `first_pull_late_ms` late) is slower than a piece.
        let (split, piece) = split_ms(p, d);
        let excess = transfer_ms(bytes, d) - piece;
        let exposed = barriers + local_ms + (first_pull_late_ms + excess).max(0.0) + (pulls - 1.0) * excess.max(0.0);
        out.push(Estimate {
            algorithm: Algorithm::Pipelined,
            compute_ms: split,
            comm_ms: comm,
            exposed_ms: exposed,
            total_ms: split + exposed,
            pieces: 1,
        });
    }
    if fused && world > 1 {
        // One kernel over the whole problem: no split or launch costs; each
        // chunk's transfer hides behind the tiles of the chunks before it,
        // and one barrier stays exposed.
        let compute = whole * d.fused_slowdown;
        let piece = compute / world as f64;
        let exposed = d.barrier_us / 1e3 + local_ms + pulls * (transfer_ms(bytes, d) - piece).max(0.0);
        out.push(Estimate {
            algorithm: Algorithm::Fused,
            compute_ms: compute,
            comm_ms: comm,
            exposed_ms: exposed,
            total_ms: compute + exposed,
            pieces: 1,
        });
    }
    out
}

/// The pipelined all-gather stages shards of at most this many bytes into
/// its workspace (a copy of a few microseconds) for the peers to pull;
/// larger ones their ranks push from the caller's memory (`ops::ag_mm`).
pub const STAGED_SHARD_BYTES: usize = 4 << 20;

/// All-gather of A (`m` rows in all) then matmul: each rank pulls every
/// peer's shard; pipelined, its own shard's piece runs first, and each
/// peer's shard may be pulled in pieces ([`gather_pieces`]).
pub fn ag_mm(p: &Problem, d: &DeviceModel) -> Vec<Estimate> {
    let shard_bytes = (p.m / p.world * p.k * p.elem_bytes) as f64;
    // A staged shard's pull starts late: it hides behind the own shard's
    // matmul only where that matmul outlasts the start and the pull
    // together (small N).
    let late = if shard_bytes <= STAGED_SHARD_BYTES as f64 { d.staged_pull_start_us / 1e3 } else { 0.0 };
    let mut out = estimates(p, matmul_ms(p, p.m, d), shard_bytes, 0.0, late, d);
    with_pieces(&mut out, gather_pieces(p, d));
    out
}

/// The pipelined estimate in `estimates` with `pieces` and what they gain.
fn with_pieces(estimates: &mut [Estimate], (pieces, gain): (usize, Gain)) {
    if let Some(e) = estimates.iter_mut().find(|e| e.algorithm == Algorithm::Pipelined) {
        e.pieces = pieces;
        e.compute_ms += gain.extra_compute;
        // The calibrated estimate may expose less than the timeline hides
        // (it charges no launch to a pull): never below nothing.
        e.exposed_ms = (e.exposed_ms - gain.saved_exposed).max(0.0);
        e.total_ms = e.compute_ms + e.exposed_ms;
    }
}

/// Rows of A a piece of the pipelined all-gather holds at least: smaller
/// matmuls lose more than the pull they hide.
const MIN_PIECE_ROWS: usize = 128;

/// The pieces each peer's shard is gathered in, at most.
pub const MAX_GATHER_PIECES: usize = 8;

/// Pieces must predict at least this share less time than whole shards: a
/// smaller gain lies within the model's error.
const PIECES_MIN_GAIN: f64 = 0.05;

/// What pulling each peer's shard in pieces changes against whole shards
/// (ms): the matmul time it adds and the communication it hides.
#[derive(Clone, Copy, Debug, Default)]
struct Gain {
    extra_compute: f64,
    saved_exposed: f64,
}

/// Of `split`'s (pieces, (compute, total)) timelines, the fastest that
/// predicts at least [`PIECES_MIN_GAIN`] less time than `whole`'s, and
/// what it gains over `whole`; else 1 piece and no gain.
fn fastest_split(whole: (f64, f64), split: impl Iterator<Item = (usize, (f64, f64))>) -> (usize, Gain) {
    let (whole_compute, whole_total) = whole;
    split
        .filter(|&(_, (_, total))| total <= (1.0 - PIECES_MIN_GAIN) * whole_total)
        .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
        .map_or((1, Gain::default()), |(c, (compute, total))| {
            let saved_exposed = (whole_total - whole_compute) - (total - compute);
            (c, Gain { extra_compute: compute - whole_compute, saved_exposed })
        })
}

/// The pieces (1, 2, 4 or 8, none of fewer than [`MIN_PIECE_ROWS`] rows,
/// at most `p.split_len`, each a run of whole indices of the first
/// dimension) the pipelined all-gather pulls each peer's shard in, and
/// what they gain over whole shards. A timeline of the two streams: the
/// main one multiplies this rank's shard, then each piece once it has
/// landed; the side one pulls the pieces back to back after a barrier,
/// each a launch and its transfer, and ends with another barrier. Where a
/// shard's pull outlasts the matmul of a shard, only the last piece's
/// matmul waits after the pulls instead of a whole shard's; elsewhere
/// pieces only add launches and split costs, and 1 is chosen. Pieces are
/// taken only where the timeline predicts [`PIECES_MIN_GAIN`] less time
/// than its own whole shards; the one-piece estimate stays the calibrated
/// one of [`estimates`], and the timeline gives the difference. Each B's
/// matmul is one launch per piece; the model counts one for all.
fn gather_pieces(p: &Problem, d: &DeviceModel) -> (usize, Gain) {
    if p.world < 2 || p.split_len < 2 {
        return (1, Gain::default());
    }
    let shard_rows = p.m / p.world;
    let per_index = (shard_rows / p.split_len).max(1);
    let piece_rows = |c: usize| p.split_len.div_ceil(c) * per_index;
    // As `split_ms` for one piece per rank; each further piece of a peer's
    // shard adds the split penalty to that shard's pieces.
    let base = 1.0 + d.split_penalty * (p.world as f64 - 1.0);
    let timeline = |c: usize| {
        let own = matmul_ms(p, shard_rows, d) * base;
        let piece = matmul_ms(p, piece_rows(c), d) * base * (1.0 + d.split_penalty * (c as f64 - 1.0));
        let pull = d.launch_us / 1e3 + transfer_ms((piece_rows(c) * p.k * p.elem_bytes) as f64, d);
        let barrier = d.barrier_us / 1e3;
        let (mut main, mut side) = (own, barrier);
        for _ in 0..(p.world - 1) * c {
            side += pull;
            main = main.max(side) + piece;
        }
        (own + piece * ((p.world - 1) * c) as f64, main.max(side + barrier))
    };
    let allowed = |&c: &usize| c <= p.split_len.min(MAX_GATHER_PIECES) && piece_rows(c) >= MIN_PIECE_ROWS;
    fastest_split(timeline(1), [2, 4, 8].into_iter().filter(allowed).map(|c| (c, timeline(c))))
}

/// Matmul of this rank's `m` rows, then reduce-scatter of the result: each
/// rank pulls the chunk every peer computed for it; pipelined, the peers'
/// chunks come first and the final reduction is local (HBM speed). Fused,
/// the reduction happens in the epilogue of this rank's own tiles, which
/// read the peers' partials from local memory.
pub fn mm_rs(p: &Problem, d: &DeviceModel) -> Vec<Estimate> {
    let chunk_bytes = (p.m / p.world * p.n * p.out_bytes) as f64;
    let local_reduce = (p.world as f64 + 1.0) * chunk_bytes / (d.hbm_gbps * 1e6);
    let whole = matmul_ms(p, p.m, d);
    let mut out = estimates(p, whole, chunk_bytes, local_reduce, 0.0, d);
    if let Some(f) = out.iter_mut().find(|e| e.algorithm == Algorithm::Fused) {
        let reads = (p.world as f64 - 1.0) * chunk_bytes / (d.hbm_gbps * 1e6);
        f.exposed_ms += reads - local_reduce;
        f.total_ms = f.compute_ms + f.exposed_ms;
    }
    with_pieces(&mut out, scatter_pieces(p, d));
    out
}

/// Whether the two-rank pipelined reduce-scatter, which multiplies its own
/// chunk in `c = p.split_len` pieces onto the partials it pulls, computes
/// the peer's chunk in the same pieces too (`c`) or whole (1), and what
/// that gains. A timeline of the two streams: the main one computes the
/// peer's chunk, announcing it whole or piece by piece in the order the
/// peer consumes them (1, .., c - 1, then 0), then its own first piece,
/// then each other piece once its partial has landed; the side one pulls
/// the pieces back to back as they are announced, each a launch and its
/// transfer; a local sum of the first piece ends the call. Whole, the
/// peer's first pull waits for its whole chunk; in pieces, for its first
/// piece, at the cost of launches and split penalties. As for
/// [`gather_pieces`], taken only where the timeline predicts
/// [`PIECES_MIN_GAIN`] less time.
fn scatter_pieces(p: &Problem, d: &DeviceModel) -> (usize, Gain) {
    let c = p.split_len;
    if p.world != 2 || c < 2 {
        return (1, Gain::default());
    }
    let rows = p.m / 2;
    let piece_rows = rows.div_ceil(c);
    let base = 1.0 + d.split_penalty;
    let piece = matmul_ms(p, piece_rows, d) * base * (1.0 + d.split_penalty * (c as f64 - 1.0));
    let piece_bytes = (piece_rows * p.n * p.out_bytes) as f64;
    let pull = d.launch_us / 1e3 + loaded_transfer_ms(piece_bytes, d);
    let (signal, sum_first) = (d.barrier_us / 1e3, 3.0 * piece_bytes / (d.hbm_gbps * 1e6));
    let timeline = |split: bool| {
        let theirs = if split { vec![piece; c] } else { vec![matmul_ms(p, rows, d) * base] };
        let mut main = 0.0;
        let announced: Vec<f64> = theirs
            .iter()
            .map(|t| {
                main += t;
                main + signal
            })
            .collect();
        let mut side = 0.0f64;
        let landed: Vec<f64> = (0..c)
            .map(|i| {
                side = side.max(announced[i.min(announced.len() - 1)]) + pull;
                side
            })
            .collect();
        main += piece;
        for at in &landed[..c - 1] {
            main = main.max(*at) + piece;
        }
        (theirs.iter().sum::<f64>() + c as f64 * piece, main.max(landed[c - 1]) + sum_first)
    };
    fastest_split(timeline(false), std::iter::once((c, timeline(true))))
}

/// The fused all-gather pulls each shard in slices of k (columns), each
/// flagged on its own, so that a tile of a peer's rows starts once the
/// first slice has landed instead of the whole shard: at small M those
/// tiles then run in the first wave beside the local ones, reading B
/// together. Slices stay large enough that a copy engine streams them at
/// speed, and few enough that their flags cost nothing.
const MIN_SLICE_BYTES: usize = 512 << 10;
const MAX_SLICES: usize = 8;

/// The width (in elements of k) of the fused all-gather's slices of a
/// shard of `shard_bytes` with `k` columns: `k` itself (one slice), or a
/// multiple of `align` that divides `k` into at most [`MAX_SLICES`] slices
/// of at least [`MIN_SLICE_BYTES`] (the most such slices).
pub fn gather_slice_k(shard_bytes: usize, k: usize, align: usize) -> usize {
    let most = (shard_bytes / MIN_SLICE_BYTES).clamp(1, MAX_SLICES);
    (2..=most).rev().find(|&s| k % (s * align) == 0).map_or(k, |s| k / s)
}

/// Communication at least this share of the matmul makes a reduce-scatter
/// "comm-heavy": there the fused kernel, whose tiles push to every peer at
/// once as they finish, was measured ahead of the pipelined path, which
/// pulls one peer's chunk at a time (bound calls, H200s): at world 2
/// mm_rs 4096x2048x8192 (share 0.54) 295 against 311 us, 2048x1536x8192
/// (0.72) 162 against 178, 3000x1024x8192 (1.07) 175 against 205; at world
/// 4 16384x1024x8192 (1.6) 891 against 1019. Below it the pipelined path
/// stayed ahead: world 4 8192x3584x8192 and 2048x3584x8192 (0.46), 794
/// against 736 and 263 against 242. The backend prefers its kernel on such
/// calls only where the rows of its tiles fill two waves or more
/// (`Capabilities::fused_scatter_preferred`): on smaller ones the share
/// counts latency, not bytes, and the other paths were faster.
pub const FUSED_SCATTER_COMM_SHARE: f64 = 0.5;

/// The same where the two-rank pipelined path computes the peer's chunk in
/// pieces ([`scatter_pieces`]): its pulls start after the first piece, and
/// the fused kernel leads only on heavier communication (graph-replayed,
/// 2 x H200): mm_rs 4096x2048x8192 (share 0.54) pipelined in pieces 237
/// against fused 253 us (bound 243 against 260), 2048x1536x8192 (0.72) 120
/// against 114, 3000x1024x8192 (1.07) 152 against 127.
pub const FUSED_SCATTER_COMM_SHARE_IN_PIECES: f64 = 0.6;

/// Whether `estimates` (an mm_rs's) are comm-heavy: the sequential path's
/// communication at least [`FUSED_SCATTER_COMM_SHARE`] of its matmul, or
/// [`FUSED_SCATTER_COMM_SHARE_IN_PIECES`] where the pipelined one is in pieces.
pub fn comm_heavy(estimates: &[Estimate]) -> bool {
    let in_pieces = estimates.iter().any(|e| e.algorithm == Algorithm::Pipelined && e.pieces > 1);
    let share = if in_pieces { FUSED_SCATTER_COMM_SHARE_IN_PIECES } else { FUSED_SCATTER_COMM_SHARE };
    estimates.iter().find(|e| e.algorithm == Algorithm::Sequential).is_some_and(|e| e.comm_ms >= share * e.compute_ms)
}

/// The automatic choice: the estimate with the smallest predicted total
/// among the sequential and pipelined paths, unless the fused one is
/// `fused_preferred`. The fused kernel's estimate is reported but not
/// otherwise preferred: measured, it lost to the pipelined path on every
/// benchmark shape but one (bench/results/, the newest complete run per
/// device), for reasons the model does not capture. Where the backend says
/// its kernel is measured ahead (`Capabilities::fused_scatter_preferred`,
/// from the shape alone: mm_rs at small M) and it can run, it is chosen.
pub fn best(estimates: &[Estimate], fused_preferred: bool) -> Estimate {
    if let Some(f) = estimates.iter().find(|e| e.algorithm == Algorithm::Fused && fused_preferred) {
        return *f;
    }
    *estimates
        .iter()
        .filter(|e| e.algorithm != Algorithm::Fused)
        .min_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
        .expect("at least the sequential estimate")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-shot while it was measured faster (worlds 2 and 4, H200s,
    /// graph-replayed), the two-shot past that.
    #[test]
    fn all_reduce_crosses_over_where_measured() {
        let one_shot = |bytes, world| {
            let (one, two) = all_reduce(bytes, world, &AllReduceModel::HOPPER, &DeviceModel::HOPPER);
            one < two
        };
        // World 2: one-shot 12.0 against 15.1 us at 1 MB, 36.6 against 58 at 8 MB.
        assert!(one_shot(8 << 10, 2) && one_shot(1 << 20, 2) && !one_shot(4 << 20, 2) && !one_shot(8 << 20, 2));
        // World 4: 14.2 against 21.6 us at 256 KB, 19.5 against 22.4 at 512 KB, 29.0 against 24.7 at 1 MB.
        assert!(one_shot(256 << 10, 4) && one_shot(512 << 10, 4) && !one_shot(1 << 20, 4));
        // More peers: the two-shot sooner.
        assert!(one_shot(64 << 10, 8) && !one_shot(1 << 20, 8));
    }

    fn prob(m: usize, k: usize, n: usize) -> Problem {
        Problem { m, k, n, world: 2, elem_bytes: 2, out_bytes: 2, fused: false, split_len: 1 }
    }

    #[test]
    fn large_ag_mm_matmul_time_is_near_measured_cublas() {
        // 16384x8192x8192 bf16 ran in 2.65-2.71 ms through cuBLAS on an H200.
        let e = ag_mm(&prob(16384, 8192, 8192), &DeviceModel::HOPPER);
        assert!((2.6..2.9).contains(&e[0].compute_ms), "{:?}", e[0]);
    }

    #[test]
    fn fp8_matmul_time_is_near_measured_cublaslt() {
        // 16384x8192x8192 e4m3 ran in 1.65 ms through cuBLASLt on an H200.
        let e = ag_mm(&Problem { elem_bytes: 1, ..prob(16384, 8192, 8192) }, &DeviceModel::HOPPER);
        assert!((1.55..1.8).contains(&e[0].compute_ms), "{:?}", e[0]);
    }

    #[test]
    fn world_one_has_only_the_sequential_plan_and_no_comm_cost_beyond_barriers() {
        let p = Problem { world: 1, ..prob(1024, 1024, 1024) };
        let e = ag_mm(&p, &DeviceModel::HOPPER);
        assert_eq!(e.len(), 1);
        assert!(e[0].comm_ms < 0.01);
    }

    #[test]
    fn benchmark_shapes_take_the_measured_faster_path() {
        // Measured on 2 x H200: pipelined won (or tied) on every shape but
        // mm_rs 512, where the fused kernel (its backend says) leads.
        for &(m, k, n) in &[(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)] {
            let p = Problem { fused: true, ..prob(m, k, n) };
            assert_eq!(best(&ag_mm(&p, &DeviceModel::HOPPER), false).algorithm, Algorithm::Pipelined);
        }
        for &(m, k, n) in &[(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)] {
            let p = Problem { fused: true, ..prob(m, k, n) };
            let want = if m == 512 { Algorithm::Fused } else { Algorithm::Pipelined };
            assert_eq!(best(&mm_rs(&p, &DeviceModel::HOPPER), m == 512).algorithm, want);
        }
        // Preferred but unable to run: the best of the others.
        assert_eq!(best(&mm_rs(&prob(512, 14336, 8192), &DeviceModel::HOPPER), true).algorithm, Algorithm::Pipelined);
    }

    #[test]
    fn negligible_communication_takes_the_sequential_path() {
        // A few KB to pull cannot pay for splitting a large matmul.
        let e = ag_mm(&prob(16, 65536, 65536), &DeviceModel::HOPPER);
        assert_eq!(best(&e, false).algorithm, Algorithm::Sequential, "{e:?}");
    }

    #[test]
    fn the_fused_kernel_hides_more_communication_and_is_offered_only_where_it_runs() {
        // One barrier and no pieces: never more exposed communication than
        // the pipelined path.
        for &(m, k, n) in &[(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)] {
            let p = Problem { fused: true, ..prob(m, k, n) };
            for est in [ag_mm(&p, &DeviceModel::HOPPER), mm_rs(&p, &DeviceModel::HOPPER)] {
                let of = |a| est.iter().find(|e| e.algorithm == a).copied().unwrap();
                assert!(of(Algorithm::Fused).exposed_ms <= of(Algorithm::Pipelined).exposed_ms, "{est:?}");
            }
        }
        // Reported, but not the automatic choice unless its backend prefers
        // it (measured faster), even where its prediction is the smallest.
        let p = Problem { fused: true, ..prob(16384, 8192, 8192) };
        let d = DeviceModel { fused_slowdown: 1.0, ..DeviceModel::HOPPER };
        let est = ag_mm(&p, &d);
        let fused = est.iter().find(|e| e.algorithm == Algorithm::Fused).unwrap();
        assert!(est.iter().all(|e| fused.total_ms <= e.total_ms), "{est:?}");
        assert_eq!(best(&est, false).algorithm, Algorithm::Pipelined);
        // Never offered at world 1 or without the kernel.
        let p = Problem { fused: true, world: 1, ..prob(1024, 1024, 1024) };
        assert!(ag_mm(&p, &DeviceModel::HOPPER).iter().all(|e| e.algorithm != Algorithm::Fused));
        assert!(mm_rs(&prob(1024, 1024, 1024), &DeviceModel::HOPPER).iter().all(|e| e.algorithm != Algorithm::Fused));
    }

    /// Pieces where a shard's pull outlasts a shard's matmul (the comm-heavy
    /// all-gathers), whole shards elsewhere; never more than the shard's
    /// first dimension allows nor of fewer than [`MIN_PIECE_ROWS`] rows.
    #[test]
    fn the_pipelined_gather_pulls_in_pieces_only_where_the_pull_is_exposed() {
        let d = &DeviceModel::HOPPER;
        let pipelined = |p: &Problem| *ag_mm(p, d).iter().find(|e| e.algorithm == Algorithm::Pipelined).unwrap();
        // Matrices gathered along dimension 0: shards of m / 2 rows.
        let rows = |m: usize, k: usize, n: usize| Problem { split_len: m / 2, ..prob(m, k, n) };
        for (m, k, n) in [(16384, 4096, 1024), (12000, 4096, 1536)] {
            let whole = pipelined(&prob(m, k, n));
            let split = pipelined(&rows(m, k, n));
            assert_eq!(whole.pieces, 1);
            assert!(split.pieces > 1, "{m}x{k}x{n}");
            assert!(split.total_ms < whole.total_ms, "{m}x{k}x{n}");
            // Pieces cost matmul time and hide pull time.
            assert!(split.compute_ms > whole.compute_ms && split.exposed_ms < whole.exposed_ms);
            assert!((split.total_ms - split.compute_ms - split.exposed_ms).abs() < 1e-12);
            // A shard [2, m / 4, k]: two pieces at most.
            assert_eq!(pipelined(&Problem { split_len: 2, ..prob(m, k, n) }).pieces, 2);
        }
        // The benchmark's shapes hide their pulls behind a shard's matmul.
        for (m, k, n) in [(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)] {
            assert_eq!(pipelined(&rows(m, k, n)), pipelined(&prob(m, k, n)), "{m}x{k}x{n}");
        }
        // Over a sweep of worlds and shapes: pieces only where allowed, of
        // at least MIN_PIECE_ROWS rows, and only where they save time.
        for world in [2, 3, 4, 8] {
            for m in [256, 512, 1024, 4096, 16384, 65536] {
                for (k, n) in [(1024, 64), (4096, 1024), (8192, 512), (65536, 64), (8192, 8192)] {
                    for split_len in [1, 2, 3, m / world] {
                        let p = Problem { world, split_len, m: m * world, ..prob(m, k, n) };
                        let (e, whole) = (pipelined(&p), pipelined(&Problem { split_len: 1, ..p }));
                        let what = format!("world {world} {m}x{k}x{n} in {split_len}");
                        assert!(e.pieces <= split_len.max(1), "{what}");
                        if e.pieces > 1 {
                            let piece_rows = split_len.div_ceil(e.pieces) * (m / split_len);
                            assert!(piece_rows >= MIN_PIECE_ROWS, "{what}: {} pieces", e.pieces);
                            assert!(e.total_ms < whole.total_ms, "{what}");
                        } else {
                            assert_eq!(e, whole, "{what}");
                        }
                    }
                }
            }
        }
    }

    /// The two-rank pipelined reduce-scatter computes the peer's chunk in
    /// pieces where the chunk's pull outlasts the peer's matmul (the
    /// comm-heavy ones), whole elsewhere, and only at two ranks.
    #[test]
    fn the_pipelined_scatter_announces_pieces_only_where_the_pull_is_exposed() {
        let d = &DeviceModel::HOPPER;
        let pipelined = |p: &Problem| *mm_rs(p, d).iter().find(|e| e.algorithm == Algorithm::Pipelined).unwrap();
        // As mm_rs cuts two-rank chunks: at most 2 pieces of 512 rows.
        let onto = |m: usize, k: usize, n: usize| Problem { split_len: (m / 2 / 512).min(2), ..prob(m, k, n) };
        for (m, k, n) in [(4096, 2048, 8192), (2048, 1536, 8192), (3000, 1024, 8192)] {
            let (whole, split) = (pipelined(&prob(m, k, n)), pipelined(&onto(m, k, n)));
            assert_eq!(whole.pieces, 1);
            assert_eq!(split.pieces, onto(m, k, n).split_len, "{m}x{k}x{n}");
            assert!(split.total_ms < whole.total_ms, "{m}x{k}x{n}: {split:?} against {whole:?}");
            assert!(split.compute_ms > whole.compute_ms && split.exposed_ms < whole.exposed_ms);
            assert!((split.total_ms - split.compute_ms - split.exposed_ms).abs() < 1e-12);
        }
        // The benchmark's shapes hide the pull behind their own pieces.
        for (m, k, n) in [(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)] {
            assert_eq!(pipelined(&onto(m, k, n)), pipelined(&prob(m, k, n)), "{m}x{k}x{n}");
        }
        // More ranks: no such path.
        for world in [3, 4, 8] {
            let p = Problem { world, split_len: 4, ..prob(4096 * world / 2, 2048, 8192) };
            assert_eq!(pipelined(&p).pieces, 1);
        }
        // ag_mm's pieces are its own.
        assert_eq!(ag_mm(&onto(4096, 2048, 8192), d).iter().map(|e| e.pieces).max(), Some(1));
    }

    #[test]
    fn gather_slices_are_aligned_few_and_large() {
        // 512x8192x14336 at world 2: a 4 MiB shard in 8 slices of 1024 columns.
        assert_eq!(gather_slice_k(256 * 8192 * 2, 8192, 128), 1024);
        // A 1 MiB shard: two slices; a small one: one slice, the whole k.
        assert_eq!(gather_slice_k(64 * 8192 * 2, 8192, 128), 4096);
        assert_eq!(gather_slice_k(8 * 96 * 2, 96, 128), 96);
        // Slices divide k in multiples of the alignment: fewer where 8 do not.
        assert_eq!(gather_slice_k(4096 * 14336 * 2, 14336, 128), 1792); // 8 slices
        assert_eq!(gather_slice_k(4096 * 1280 * 2, 1280, 128), 256); // 5
        assert_eq!(gather_slice_k(4096 * 1000 * 2, 1000, 128), 1000); // none divides
        for k in (128..20000).step_by(64) {
            let w = gather_slice_k(4096 * k * 2, k, 128);
            assert!(w == k || (k % w == 0 && w % 128 == 0 && k / w <= MAX_SLICES), "k {k}: {w}");
        }
    }

    /// The LL path wins up to a few MiB per rank at two ranks (where NCCL
    /// still leads the copy engines), less with more ranks (each moves
    /// twice the message to every peer), and never on large messages.
    #[test]
    fn lc_allgather_takes_the_lines_when_small() {
        let (m, d) = (GatherModel::HOPPER, DeviceModel::HOPPER);
        let lines_win = |bytes: usize, world: usize| {
            let (copies, lines) = lc_allgather(bytes, world, &m, &d);
            lines < copies
        };
        // The sizes measured against NCCL: 64K, 256K and 1M bf16 per rank.
        for bytes in [8, 64 << 10, 128 << 10, 512 << 10, 2 << 20, 4 << 20] {
            assert!(lines_win(bytes, 2), "{bytes} bytes at two ranks");
        }
        for bytes in [8 << 20, 64 << 20, 1 << 30] {
            assert!(!lines_win(bytes, 2), "{bytes} bytes at two ranks");
        }
        let crossover = |world: usize| (1..4096).map(|i| i << 12).find(|&b| !lines_win(b, world)).unwrap();
        assert!((4 << 20..7 << 20).contains(&crossover(2)), "{}", crossover(2));
        assert!(crossover(8) < crossover(4) && crossover(4) < crossover(2));
        assert!(crossover(8) >= 512 << 10, "{}", crossover(8));
        // A tiny message: the fixed costs alone.
        let (copies, lines) = lc_allgather(0, 2, &m, &d);
        assert!((copies - 0.025).abs() < 1e-9 && (lines - 0.004).abs() < 1e-9);
    }

    #[test]
    fn exposed_comm_never_exceeds_comm_plus_local_work() {
        for &(m, k, n) in &[(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)] {
            for e in mm_rs(&prob(m, k, n), &DeviceModel::HOPPER) {
                assert!(e.exposed_ms <= e.comm_ms + 0.1, "{e:?}");
                assert!(e.total_ms >= e.compute_ms, "{e:?}");
            }
        }
    }
}
