//! The one place that chooses the algorithm of an operation (`fused_ag_mm`,
//! `mm_rs`, `all_reduce`, `lc_allgather`): a pure function of the call's agreed
//! arguments (its shape and dtype, whether its operands suit the fused
//! kernel, the algorithm its options ask for) and the group's facts (the
//! backend's [`Capabilities`], the world, whether every rank has a device
//! of its own, the agreed `SYMM_ALGO`). The operations and the C query
//! `symm_plan_*` both call [`decide`], and the operations put its answer
//! in the call's signature, so ranks never run different algorithms.
//!
//! Order: the call's option, else the group's `SYMM_ALGO`, else the cost
//! model's best ([`cost::best`]). A forced `fused` the call cannot run is
//! an error (Unsupported), never a silent fallback, so that a benchmark
//! never measures something else than it asked for.

use crate::array::DType;
use crate::backend::AllReduceLayout;
use crate::backend::{AllReduceAlgorithm, BackendKind, Capabilities};
use crate::cost::{self, Algorithm, AllReduceModel, DeviceModel, Estimate, GatherModel, NcclModel, Problem};
use crate::error::{err, Result};
use crate::group::Group;
use std::fmt;

/// The fused operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    AgMm,
    MmRs,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AgMm => "fused_ag_mm",
            Op::MmRs => "mm_rs",
        }
    }
}

/// A call's shape as the decision sees it.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub op: Op,
    /// Rows of A: all ranks' for `AgMm`, this rank's for `MmRs`.
    pub m: usize,
    pub k: usize,
    /// Sum of the N of every B.
    pub n: usize,
    pub dtype: DType,
    /// Bytes per element of the product: for `MmRs`, of the partials the
    /// ranks exchange (an fp8 matmul's are bf16, f16 or f32).
    pub out_bytes: usize,
    /// Whether the sequential path may move its data on the LL lines:
    /// `AgMm`, a gather along a dimension before the last (with row-wise
    /// scales, rows a multiple of 4: their slots unpadded); `MmRs`, chunks
    /// of whole 8-byte lines.
    pub lines: bool,
    /// Where the pipelined path may pull each peer's shard in pieces along
    /// its first dimension (`AgMm` gathering a dimension before the last:
    /// the first, or the sequence of a batch; not fp8): the shard's length
    /// there; 1 elsewhere.
    pub split_len: usize,
}

/// What the decision knows of a group (equal on every rank of a formed
/// group: the backend kind, the ranks' devices and the settings agreed).
#[derive(Clone, Copy, Debug)]
pub struct Facts {
    pub caps: Capabilities,
    pub world: usize,
    /// Every rank on a device of its own (two ranks' persistent kernels on
    /// one GPU would wait for each other); always on the host backend, whose
    /// ranks wait for each other on threads of their own.
    pub own_devices: bool,
    /// The group's `SYMM_ALGO`.
    pub setting: Option<Algorithm>,
}

impl Facts {
    pub fn of(group: &Group) -> Facts {
        let t = group.topology();
        let placed = group.ranks().iter().enumerate().map(|(r, info)| (t.host_of(r), info.device));
        Facts {
            caps: group.backend().capabilities(),
            world: group.world(),
            own_devices: all_distinct(placed) || group.backend().kind() == BackendKind::Host,
            setting: group.settings().algorithm,
        }
    }

    /// Whether the group can run a fused kernel for `dtype` (bf16, f16 or
    /// fp8) with inner size `k` (rows of whole 16-byte units, TMA's rule);
    /// the call's layout is checked apart (`fused::field`).
    pub fn fused_possible(&self, dtype: DType, k: usize) -> bool {
        self.caps.fused_matmul
            && (2..=self.caps.max_fused_world).contains(&self.world)
            && self.own_devices
            && (matches!(dtype, DType::BF16 | DType::F16) || dtype.fp8().is_some())
            && (k * dtype.size()) % 16 == 0
            && k <= i32::MAX as usize
    }
}

/// Why an algorithm was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The call's options asked for it.
    Option,
    /// The group's `SYMM_ALGO`.
    Env,
    /// The cost model's best (`fused_preferred`: the backend measured its
    /// fused kernel ahead on this shape).
    CostModel { fused_preferred: bool },
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::Option => write!(f, "forced by the call's options"),
            Why::Env => write!(f, "forced by SYMM_ALGO"),
            Why::CostModel { fused_preferred: true } => write!(f, "the fused kernel, measured ahead on such shapes"),
            Why::CostModel { fused_preferred: false } => write!(f, "the cost model"),
        }
    }
}

/// The algorithm a call runs, why, and the cost model's estimate of it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub algorithm: Algorithm,
    pub why: Why,
    pub estimate: Estimate,
    /// Sequential: the data moves on the LL lines (one launch of the
    /// device-side all-gather or reduce-scatter, no barrier; the
    /// reduce-scatter by pieces where [`reduce_scatter_kernel`] says)
    /// instead of the copy engines (`AgMm`) or reads of the peers' chunks
    /// between two barriers (`MmRs`).
    pub lines: bool,
    /// Pipelined `AgMm`: the pieces each peer's shard is pulled and
    /// multiplied in; pipelined `MmRs`: the pieces the peer's chunk is
    /// computed and announced in (1 otherwise).
    pub pieces: usize,
}

impl Decision {
    /// One line for the log: the operation, its shape, the choice and why.
    pub fn describe(&self, shape: &Shape) -> String {
        format!(
            "{} m={} k={} n={} {}: {}{}{} ({}; predicted {:.3} ms)",
            shape.op.name(),
            shape.m,
            shape.k,
            shape.n,
            shape.dtype,
            self.algorithm.name(),
            match (self.lines, shape.op) {
                (false, _) => "",
                (true, Op::AgMm) => " on the LL lines",
                (true, Op::MmRs) => " on the device-side reduce-scatter",
            },
            match (self.pieces, shape.op) {
                (1, _) => String::new(),
                (p, Op::AgMm) => format!(", each shard in {p} pieces"),
                (p, Op::MmRs) => format!(", the peer's chunk in {p} pieces"),
            },
            self.why,
            self.estimate.total_ms
        )
    }
}

/// The algorithm `shape` runs on a group with `facts`; `fits`: whether the
/// call's operands suit the fused kernel (its layout); `requested`: the
/// call's option (`None`: automatic). The sequential path moves its data
/// on the LL lines where `lc_allgather` would for one shard
/// ([`decide_lc_allgather`]: small shards, at decode sizes) of what each
/// rank sends each peer (`AgMm`: its shard of A; `MmRs`: a chunk of its
/// product; for `MmRs` only where they beat its barriers and reads of the
/// peers' chunks), and is estimated so.
pub fn decide(facts: &Facts, shape: &Shape, fits: bool, requested: Option<Algorithm>) -> Result<Decision> {
    let world = facts.world;
    let fused = fits && facts.fused_possible(shape.dtype, shape.k);
    let problem = Problem {
        m: shape.m,
        k: shape.k,
        n: shape.n,
        world,
        elem_bytes: shape.dtype.size(),
        out_bytes: shape.out_bytes,
        fused,
        split_len: shape.split_len,
    };
    let mut estimates = match shape.op {
        Op::AgMm => cost::ag_mm(&problem, &DeviceModel::HOPPER),
        Op::MmRs => cost::mm_rs(&problem, &DeviceModel::HOPPER),
    };
    // The lines' time, where the sequential path moves its data on them.
    let (per_peer, elem) = match shape.op {
        Op::AgMm => (shape.k, shape.dtype.size()),
        Op::MmRs => (shape.n, shape.out_bytes),
    };
    let sent = (shape.m / world.max(1)).saturating_mul(per_peer).saturating_mul(elem);
    let lines = shape
        .lines
        .then(|| decide_lc_allgather(facts, sent, None).ok())
        .flatten()
        .filter(|g| g.path == GatherPath::Lines)
        .map(|g| match shape.op {
            Op::AgMm => g.total_ms,
            Op::MmRs => reduce_scatter_kernel(sent, world).1,
        })
        // AgMm: where lc_allgather takes them (measured ahead of the copy
        // engines there); MmRs: where they beat its barriers and reads.
        .filter(|&l| {
            shape.op == Op::AgMm || estimates.iter().any(|e| e.algorithm == Algorithm::Sequential && l < e.comm_ms)
        });
    if let Some(gather) = lines {
        for e in estimates.iter_mut().filter(|e| e.algorithm == Algorithm::Sequential) {
            (e.comm_ms, e.exposed_ms, e.total_ms) = (gather, gather, e.compute_ms + gather);
        }
    }
    let decided = |algorithm: Algorithm, why: Why, estimate: Estimate| Decision {
        algorithm,
        why,
        estimate,
        lines: lines.is_some() && algorithm == Algorithm::Sequential,
        pieces: if algorithm == Algorithm::Pipelined { estimate.pieces } else { 1 },
    };
    let forced = match (requested, facts.setting) {
        (Some(a), _) => Some((a, Why::Option)),
        (None, Some(a)) => Some((a, Why::Env)),
        (None, None) => None,
    };
    match forced {
        Some((Algorithm::Fused, why)) if !fused => {
            let asked = match why {
                Why::Option => "the call's options ask for the fused algorithm",
                _ => "SYMM_ALGO=fused",
            };
            Err(err!(
                Unsupported,
                "{asked}, but the fused kernel cannot run this call: it needs every rank on a GPU of its own \
                 that runs symm's sm_90a kernels, bf16 or f16 operands with k a multiple of 8, gather/scatter \
                 dimension 0 of matrices, B K-major (a Linear weight's transpose) and 16-byte aligned rows"
            ))
        }
        Some((algorithm, why)) => {
            let estimate = estimates
                .iter()
                .find(|e| e.algorithm == algorithm)
                .copied()
                .unwrap_or_else(|| cost::best(&estimates, false));
            Ok(decided(algorithm, why, estimate))
        }
        None => {
            // The fused reduce-scatter where the backend measured its kernel
            // ahead on the shape, given how heavy the communication is.
            let fused_preferred = shape.op == Op::MmRs
                && fused
                && shape.m % world == 0
                && (facts.caps.fused_scatter_preferred)(
                    shape.m / world,
                    shape.n,
                    world,
                    shape.dtype.size(),
                    cost::comm_heavy(&estimates),
                );
            let estimate = cost::best(&estimates, fused_preferred);
            Ok(decided(estimate.algorithm, Why::CostModel { fused_preferred }, estimate))
        }
    }
}

/// The all-reduce's decision: its algorithm, why, and the predicted time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AllReduceDecision {
    pub algorithm: AllReduceAlgorithm,
    pub why: Why,
    pub total_ms: f64,
}

impl AllReduceDecision {
    /// One line for the log.
    pub fn describe(&self, numel: usize, dtype: DType, world: usize) -> String {
        format!(
            "all_reduce n={numel} {dtype} world={world}: {} ({}; predicted {:.4} ms)",
            self.algorithm.name(),
            self.why,
            self.total_ms
        )
    }
}

/// The algorithm of an all-reduce of `numel` elements of `dtype` on a group
/// with `facts`: the call's option, else the cheaper by the cost model
/// (`cost::all_reduce`). A pure function of agreed arguments, so every
/// rank chooses alike.
pub fn decide_all_reduce(
    facts: &Facts,
    numel: usize,
    dtype: DType,
    requested: Option<AllReduceAlgorithm>,
) -> AllReduceDecision {
    let bytes = numel.saturating_mul(dtype.size());
    let (one, two) = cost::all_reduce(bytes, facts.world, &AllReduceModel::HOPPER, &DeviceModel::HOPPER);
    let ms = |a| if a == AllReduceAlgorithm::OneShot { one } else { two };
    match requested {
        Some(a) => AllReduceDecision { algorithm: a, why: Why::Option, total_ms: ms(a) },
        None => {
            // One rank has nothing to exchange: the one-shot is a copy.
            let a =
                if one <= two || facts.world < 2 { AllReduceAlgorithm::OneShot } else { AllReduceAlgorithm::TwoShot };
            AllReduceDecision { algorithm: a, why: Why::CostModel { fused_preferred: false }, total_ms: ms(a) }
        }
    }
}

/// The kernel of a device-side reduce-scatter of `bytes` per chunk over
/// `world` ranks (mm_rs's sequential path off the barriers): the LL lines
/// (`OneShot`) or pieces with flags (`TwoShot`), whichever the cost model
/// has cheaper, with its predicted time. A pure function of agreed
/// arguments, so every rank launches the same kernel.
pub fn reduce_scatter_kernel(bytes: usize, world: usize) -> (AllReduceAlgorithm, f64) {
    let lines = cost::reduce_scatter_lines(bytes, world, &DeviceModel::HOPPER);
    cheaper_kernel(lines, cost::reduce_scatter_pieces(bytes, world, &AllReduceModel::HOPPER))
}

/// The kernel of a device-side all-gather of `bytes` per rank over `world`
/// ranks: the LL lines (`OneShot`) or pieces with flags (`TwoShot`),
/// whichever the cost model has cheaper, with its predicted time. A pure
/// function of agreed arguments, so every rank launches the same kernel.
pub fn all_gather_kernel(bytes: usize, world: usize) -> (AllReduceAlgorithm, f64) {
    let lines = cost::lc_allgather(bytes, world, &GatherModel::HOPPER, &DeviceModel::HOPPER).1;
    cheaper_kernel(lines, cost::all_gather_pieces(bytes, world, &AllReduceModel::HOPPER))
}

/// The LL lines (`OneShot`, on a tie) or the pieces (`TwoShot`) by their
/// predicted times (ms), with the chosen one's.
fn cheaper_kernel(lines: f64, pieces: f64) -> (AllReduceAlgorithm, f64) {
    if lines <= pieces {
        (AllReduceAlgorithm::OneShot, lines)
    } else {
        (AllReduceAlgorithm::TwoShot, pieces)
    }
}

/// How `lc_allgather` moves its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatherPath {
    /// Copy-engine pulls between barriers: no SM is used, which is what
    /// the low-contention gather is for, at a fixed cost of ~25 us.
    CopyEngines,
    /// The device-side all-gather (`Backend::all_gather`): the one-shot
    /// all-reduce's LL lines, placed instead of summed; a few us, for
    /// small messages, where contention for SMs does not matter.
    Lines,
}

impl GatherPath {
    pub fn name(self) -> &'static str {
        match self {
            GatherPath::CopyEngines => "copy_engines",
            GatherPath::Lines => "lines",
        }
    }
}

/// `lc_allgather`'s decision: its path, why, and the predicted time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatherDecision {
    pub path: GatherPath,
    pub why: Why,
    pub total_ms: f64,
}

/// The path of an `lc_allgather` of `bytes` per rank on a group with
/// `facts`: `requested` (tests force a path), else the LL lines where the
/// backend has the kernel, every rank has a device of its own (the
/// kernel's blocks spin for their peers'), there are peers and at most
/// [`AllReduceLayout::MAX_WORLD`] ranks, and the cost model
/// ([`cost::lc_allgather`]) predicts the LL lines faster; else the copy
/// engines, which leave the SMs to the caller's work. On the lines path
/// larger messages may move by pieces ([`all_gather_kernel`]), and its
/// estimate is that kernel's. A pure function of agreed arguments, so
/// every rank chooses alike. A requested path the backend cannot run is
/// an error (Unsupported).
pub fn decide_lc_allgather(facts: &Facts, bytes: usize, requested: Option<GatherPath>) -> Result<GatherDecision> {
    let world = facts.world;
    let (copies, lines) = cost::lc_allgather(bytes, world, &GatherModel::HOPPER, &DeviceModel::HOPPER);
    let ms = |p| if p == GatherPath::Lines { all_gather_kernel(bytes, world).1 } else { copies };
    let kernel = facts.caps.all_gather && world <= AllReduceLayout::MAX_WORLD;
    match requested {
        Some(GatherPath::Lines) if !kernel => Err(err!(
            Unsupported,
            "the LL all-gather needs a backend with the device-side all-gather and at most {} ranks (here {world})",
            AllReduceLayout::MAX_WORLD
        )),
        Some(p) => Ok(GatherDecision { path: p, why: Why::Option, total_ms: ms(p) }),
        None => {
            let p = if kernel && facts.own_devices && world > 1 && bytes > 0 && lines < copies {
                GatherPath::Lines
            } else {
                GatherPath::CopyEngines
            };
            Ok(GatherDecision { path: p, why: Why::CostModel { fused_preferred: false }, total_ms: ms(p) })
        }
    }
}

/// Whether every rank's device is its own: no two ranks on one device of
/// one host (device ordinals repeat from host to host).
fn all_distinct(placed: impl Iterator<Item = (Option<usize>, i32)>) -> bool {
    let mut devices: Vec<_> = placed.collect();
    let n = devices.len();
    devices.sort_unstable();
    devices.dedup();
    devices.len() == n
}

/// Whether `fused_ag_mm` across hosts is split into one matmul per shard
/// so that the gather overlaps them (this host's shards multiplied while
/// the other hosts' travel): where each shard's matmul, `piece_rows` rows
/// of operands of `dtype`, is compute-bound (its flops take at least twice
/// as long as reading its B once: the ratio does not depend on K or N), so
/// that the split costs little. At decode sizes a shard reads all of B for
/// a few rows, and one matmul stays cheaper.
pub fn across_hosts_overlap(piece_rows: usize, dtype: DType) -> bool {
    let d = DeviceModel::HOPPER;
    let tflops = if dtype.size() == 1 { d.fp8_matmul_tflops } else { d.matmul_tflops };
    // Per element of B (k x n): 2 x rows flops against `size` bytes read.
    let compute_ms = 2.0 * piece_rows as f64 / (tflops * 1e9);
    let read_ms = dtype.size() as f64 / (d.hbm_gbps * 1e6);
    compute_ms >= 2.0 * read_ms
}

/// A step of the level inside a host, in an operation across hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InsideStep {
    AllGather,
    ReduceScatter,
}

/// Whether a step inside this host of an operation across hosts moves
/// `bytes` per rank (each piece gathered, each chunk reduced) on the LL
/// lines (`Backend::all_gather` / `Backend::reduce_scatter` through the
/// all-reduce buffer, which the host's ranks map) instead of NCCL: where
/// the backend has the kernels, every rank has a device of its own, a host
/// holds 2 to [`AllReduceLayout::MAX_WORLD`] ranks (`local_world`, equal
/// on every host), and the cost model predicts the lines faster
/// ([`cost::nccl_inside`]): small messages, where NCCL's fixed cost
/// dominates. A pure function of agreed arguments, so every rank chooses alike.
pub fn inside_on_lines(facts: &Facts, local_world: usize, step: InsideStep, bytes: usize) -> bool {
    let kernel = facts.caps.all_gather && facts.own_devices;
    if !kernel || !(2..=AllReduceLayout::MAX_WORLD).contains(&local_world) || bytes == 0 {
        return false;
    }
    let d = DeviceModel::HOPPER;
    let lines = match step {
        InsideStep::AllGather => cost::lc_allgather(bytes, local_world, &GatherModel::HOPPER, &d).1,
        InsideStep::ReduceScatter => cost::reduce_scatter_lines(bytes, local_world, &d),
    };
    lines < cost::nccl_inside(bytes, local_world, &NcclModel::HOPPER)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CUDA backend's capabilities on a Hopper device.
    fn hopper(world: usize, setting: Option<Algorithm>) -> Facts {
        Facts {
            caps: Capabilities {
                fused_matmul: true,
                max_fused_world: 16,
                gather_slice_align: 128,
                fused_scatter_preferred: crate::backend::cuda::sm90::fused_scatter_preferred,
                all_reduce: true,
                reduce_integers: false,
                all_gather: true,
            },
            world,
            own_devices: true,
            setting,
        }
    }

    fn shape(op: Op, m: usize, k: usize, n: usize) -> Shape {
        // An AgMm of matrices gathered along dimension 0.
        let split_len = if op == Op::AgMm { m / 2 } else { 1 };
        Shape { op, m, k, n, dtype: DType::BF16, out_bytes: 2, lines: true, split_len }
    }

    /// A comm-heavy all-gather runs pipelined in pieces and says so; an
    /// mm_rs, a sequential call and a call that may not split never do.
    #[test]
    fn comm_heavy_gathers_are_pulled_in_pieces() {
        let f = hopper(2, None);
        let s = shape(Op::AgMm, 16384, 4096, 1024);
        let d = decide(&f, &s, true, None).unwrap();
        assert_eq!((d.algorithm, d.pieces), (Algorithm::Pipelined, 4));
        assert!(d.describe(&s).contains("pipelined, each shard in 4 pieces"), "{}", d.describe(&s));
        assert_eq!(decide(&f, &Shape { split_len: 1, ..s }, true, None).unwrap().pieces, 1);
        // A [2, 4096, 4096] shard: its first dimension allows two pieces.
        assert_eq!(decide(&f, &Shape { split_len: 2, ..s }, true, None).unwrap().pieces, 2);
        assert_eq!(decide(&f, &s, true, Some(Algorithm::Sequential)).unwrap().pieces, 1);
        // mm_rs 4096x2048x8192 pipelined: the peer's chunk in the four
        // pieces its own is cut into.
        assert_eq!(decide(&f, &shape(Op::MmRs, 4096, 2048, 8192), true, None).unwrap().pieces, 1);
        let s = Shape { split_len: 4, ..shape(Op::MmRs, 4096, 2048, 8192) };
        let d = decide(&f, &s, true, Some(Algorithm::Pipelined)).unwrap();
        assert_eq!(d.pieces, 4);
        assert!(d.describe(&s).contains("pipelined, the peer's chunk in 4 pieces"), "{}", d.describe(&s));
    }

    #[test]
    fn automatic_choices_are_the_cost_model_s() {
        let f = hopper(2, None);
        for &(m, k, n) in &[(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)] {
            let d = decide(&f, &shape(Op::AgMm, m, k, n), true, None).unwrap();
            assert_eq!(d.algorithm, Algorithm::Pipelined, "ag_mm {m}");
            assert_eq!(d.why, Why::CostModel { fused_preferred: false });
        }
        for &(m, k, n) in &[(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)] {
            let d = decide(&f, &shape(Op::MmRs, m, k, n), true, None).unwrap();
            let want = if m == 512 { Algorithm::Fused } else { Algorithm::Pipelined };
            assert_eq!(d.algorithm, want, "mm_rs {m}");
            // Preferred, but the layout does not suit the kernel.
            let d = decide(&f, &shape(Op::MmRs, m, k, n), false, None).unwrap();
            assert_eq!(d.algorithm, Algorithm::Pipelined, "mm_rs {m}, unfit");
        }
        // Without the kernel, on shared devices, at world 1, in f32: never fused.
        let host = Facts { caps: Capabilities::default(), ..f };
        let shared = Facts { own_devices: false, ..f };
        for facts in [host, shared, hopper(1, None)] {
            let d = decide(&facts, &shape(Op::MmRs, 512, 14336, 8192), true, None).unwrap();
            assert_ne!(d.algorithm, Algorithm::Fused, "{facts:?}");
        }
        let f32_call = Shape { dtype: DType::F32, ..shape(Op::MmRs, 512, 14336, 8192) };
        assert_ne!(decide(&f, &f32_call, true, None).unwrap().algorithm, Algorithm::Fused);
    }

    /// A staged shard's pull starts late (`DeviceModel::staged_pull_start_us`):
    /// where the own shard's matmul is short (small N) it no longer hides
    /// the pull, and the gather runs sequentially, as measured faster on
    /// 2 x H200 (graph-replayed, us): 578x7168x2240 52.5 against 59.5,
    /// 780x4096x1280 37.7 against 44.8. Where it is long (550x7168x7168: 99.8
    /// pipelined against 109.9), and for pushed shards (2412x4096x1408,
    /// 9.4 MiB: 77.9 against 102.4), pipelined stays.
    #[test]
    fn small_gathers_with_short_matmuls_run_sequentially() {
        let f = hopper(2, None);
        for &(m, k, n, want) in &[
            (578, 7168, 2240, Algorithm::Sequential),
            (780, 4096, 1280, Algorithm::Sequential),
            (550, 7168, 7168, Algorithm::Pipelined),
            (2412, 4096, 1408, Algorithm::Pipelined),
        ] {
            let d = decide(&f, &shape(Op::AgMm, m, k, n), true, None).unwrap();
            assert_eq!(d.algorithm, want, "ag_mm {m}x{k}x{n}");
        }
        // The start costs the pipelined estimate exactly its excess over
        // the own shard's matmul.
        let s = shape(Op::AgMm, 578, 7168, 2240);
        let pipelined = |d: &DeviceModel| {
            let p =
                Problem { m: s.m, k: s.k, n: s.n, world: 2, elem_bytes: 2, out_bytes: 2, fused: false, split_len: 1 };
            cost::ag_mm(&p, d).into_iter().find(|e| e.algorithm == Algorithm::Pipelined).unwrap().total_ms
        };
        let hopper = DeviceModel::HOPPER;
        let late = pipelined(&hopper) - pipelined(&DeviceModel { staged_pull_start_us: 0.0, ..hopper });
        assert!(late > 0.005 && late < hopper.staged_pull_start_us / 1e3, "{late}");
    }

    /// Decode sizes gather on the LL lines, sequentially, estimated at the
    /// lines' cost; not where the gather is large, on shared devices, or
    /// where the call cannot use the lines (`Shape::lines`).
    #[test]
    fn decode_sizes_gather_on_the_lines() {
        for world in [2, 4, 8] {
            let f = hopper(world, None);
            for m in [16, 64, 128, 256] {
                let d = decide(&f, &shape(Op::AgMm, m, 8192, 14336), true, None).unwrap();
                assert_eq!((d.algorithm, d.lines), (Algorithm::Sequential, true), "ag_mm {m} at world {world}");
                let shard = m / world * 8192 * 2;
                let (_, lines) = all_gather_kernel(shard, world);
                assert_eq!(d.estimate.comm_ms, lines);
                assert_eq!(d.estimate.total_ms, d.estimate.compute_ms + lines);
                assert!(d.describe(&shape(Op::AgMm, m, 8192, 14336)).contains("sequential on the LL lines"));
            }
            // Forced sequential takes the lines too; pipelined never does.
            let s = shape(Op::AgMm, 64, 8192, 14336);
            assert!(decide(&f, &s, true, Some(Algorithm::Sequential)).unwrap().lines);
            assert!(!decide(&f, &s, true, Some(Algorithm::Pipelined)).unwrap().lines);
            let shared = Facts { own_devices: false, ..f };
            let no_lines = Shape { lines: false, ..s };
            for (facts, s) in [(shared, s), (f, no_lines)] {
                assert!(!decide(&facts, &s, true, Some(Algorithm::Sequential)).unwrap().lines, "{facts:?} {s:?}");
            }
            // A large shard (64 MiB): the copy engines, pipelined.
            let d = decide(&f, &shape(Op::AgMm, 4096 * world, 8192, 8192), true, None).unwrap();
            assert_eq!((d.algorithm, d.lines), (Algorithm::Pipelined, false), "world {world}");
        }
    }

    /// Decode sizes of mm_rs reduce-scatter sequentially on the device-side
    /// kernel, estimated at its cost (`reduce_scatter_kernel`), where the
    /// cost model has it ahead of the barriers and reads of the peers'
    /// chunks; never on shared devices.
    #[test]
    fn small_reduce_scatters_take_the_kernel_where_it_beats_the_barriers() {
        // At world 2 (at 4 the lines carry three chunks: not at these sizes).
        let world = 2;
        let f = hopper(world, None);
        // Chunks of 64, 128 and 512 KiB.
        for m in [4 * world, 8 * world, 32 * world] {
            let s = shape(Op::MmRs, m, 28672 / world, 8192);
            let d = decide(&f, &s, true, None).unwrap();
            assert_eq!((d.algorithm, d.lines), (Algorithm::Sequential, true), "mm_rs {m} at world {world}");
            let chunk = m / world * 8192 * 2;
            let kernel = reduce_scatter_kernel(chunk, world).1;
            assert_eq!(d.estimate.comm_ms, kernel);
            assert!(d.describe(&s).contains("sequential on the device-side reduce-scatter"), "{}", d.describe(&s));
            let without = decide(&f, &Shape { lines: false, ..s }, true, None).unwrap();
            assert!(kernel < without.estimate.comm_ms && d.estimate.total_ms < without.estimate.total_ms);
            let shared = Facts { own_devices: false, ..f };
            assert!(!decide(&shared, &s, true, Some(Algorithm::Sequential)).unwrap().lines);
        }
    }

    /// The device-side reduce-scatter: the LL lines for the smallest
    /// chunks (one trip, no fence), pieces once the lines' doubled bytes
    /// cost more than the fence; the cheaper estimate either way.
    #[test]
    fn reduce_scatter_kernels_part_by_size() {
        for world in [2, 4] {
            assert_eq!(reduce_scatter_kernel(8 << 10, world).0, AllReduceAlgorithm::OneShot, "world {world}");
            assert_eq!(reduce_scatter_kernel(1 << 20, world).0, AllReduceAlgorithm::TwoShot, "world {world}");
            for bytes in [1, 64 << 10, 128 << 10, 512 << 10, 8 << 20] {
                let lines = cost::reduce_scatter_lines(bytes, world, &DeviceModel::HOPPER);
                let pieces = cost::reduce_scatter_pieces(bytes, world, &AllReduceModel::HOPPER);
                assert_eq!(reduce_scatter_kernel(bytes, world).1, lines.min(pieces), "{bytes} bytes at {world}");
            }
        }
    }

    /// The device-side all-gather: the LL lines for small messages, pieces
    /// once the lines' doubled bytes cost more than the fence and flags;
    /// the cheaper estimate either way, and `lc_allgather`'s on its lines.
    #[test]
    fn all_gather_kernels_part_by_size() {
        for world in [2, 4] {
            assert_eq!(all_gather_kernel(64 << 10, world).0, AllReduceAlgorithm::OneShot, "world {world}");
            assert_eq!(all_gather_kernel(4 << 20, world).0, AllReduceAlgorithm::TwoShot, "world {world}");
            for bytes in [1, 64 << 10, 512 << 10, 2 << 20, 8 << 20] {
                let lines = cost::lc_allgather(bytes, world, &GatherModel::HOPPER, &DeviceModel::HOPPER).1;
                let pieces = cost::all_gather_pieces(bytes, world, &AllReduceModel::HOPPER);
                assert_eq!(all_gather_kernel(bytes, world).1, lines.min(pieces), "{bytes} bytes at {world}");
                let f = hopper(world, None);
                let d = decide_lc_allgather(&f, bytes, Some(GatherPath::Lines)).unwrap();
                assert_eq!(d.total_ms, lines.min(pieces));
            }
        }
    }

    /// A comm-heavy mm_rs takes the fused kernel where it fits, as measured
    /// (`cost::FUSED_SCATTER_COMM_SHARE`, `_IN_PIECES` where the two-rank
    /// pipelined path computes the peer's chunk in pieces); not below that
    /// share, not where its tiles make less than two waves (small chunks,
    /// where the communication is latency more than bytes), not where the
    /// kernel cannot run, never an ag_mm.
    #[test]
    fn comm_heavy_reduce_scatters_take_the_fused_kernel() {
        let cases = [
            (2, (4096, 2048, 8192), false), // pipelined, the peer's chunk in pieces
            (2, (2048, 1536, 8192), true),
            (2, (3000, 1024, 8192), true),
            (2, (3001, 1024, 8192), false), // rows that do not divide into the world's chunks
            (4, (16384, 1024, 8192), true),
            (4, (8192, 3584, 8192), false),
            (4, (2048, 3584, 8192), false),
            (2, (16384, 4096, 8192), false),
            // Comm-heavy by the share, in less than two waves of tiles.
            (2, (62, 2048, 4096), false),
            (2, (340, 4096, 8192), false),
            (2, (414, 2816, 6144), false),
        ];
        for (world, (m, k, n), fused) in cases {
            let f = hopper(world, None);
            // As mm_rs prepares a sum of matrices scattered by rows.
            let onto = if world == 2 { crate::ops::mm_rs::onto_pull_pieces_of(m / 2, m / 2).unwrap_or(1) } else { 1 };
            let s = Shape { split_len: onto, ..shape(Op::MmRs, m, k, n) };
            let d = decide(&f, &s, true, None).unwrap();
            assert_eq!(d.algorithm == Algorithm::Fused, fused, "mm_rs {m}x{k}x{n} at world {world}: {d:?}");
            let unfit = decide(&f, &s, false, None).unwrap();
            assert_ne!(unfit.algorithm, Algorithm::Fused);
            assert_ne!(decide(&f, &shape(Op::AgMm, m, k, n), true, None).unwrap().algorithm, Algorithm::Fused);
            // fp8 into bf16 moves as much in a faster matmul, and its chunks
            // stay whole: comm-heavy wherever bf16 is at the plain share
            // (measured ahead there too, despite its exact accumulation:
            // bench/results/2026-11-29-h200-x2-285f8f0-*).
            let fp8 = Shape { dtype: DType::F8E4M3, ..shape(Op::MmRs, m, k, n) };
            let whole = decide(&f, &shape(Op::MmRs, m, k, n), true, None).unwrap();
            if whole.algorithm == Algorithm::Fused {
                assert_eq!(decide(&f, &fp8, true, None).unwrap().algorithm, Algorithm::Fused, "fp8 {m}x{k}x{n}");
            }
        }
        // Without the pieces, 4096x2048x8192 is comm-heavy at the plain share.
        let whole = decide(&hopper(2, None), &shape(Op::MmRs, 4096, 2048, 8192), true, None).unwrap();
        assert_eq!(whole.algorithm, Algorithm::Fused);
    }

    /// An mm_rs moves its partials, in the product's type: fp8 operands
    /// into a bf16 product move as much as bf16 ones (their matmul is
    /// faster), and decide the lines alike; an f32 product moves twice that.
    #[test]
    fn mm_rs_moves_its_partials_in_the_product_s_type() {
        let f = hopper(2, None);
        for m in [16, 64, 128, 256, 4096] {
            let bf16 = decide(&f, &shape(Op::MmRs, m, 14336, 8192), true, None).unwrap();
            let fp8 = Shape { dtype: DType::F8E4M3, ..shape(Op::MmRs, m, 14336, 8192) };
            let d = decide(&f, &fp8, true, None).unwrap();
            assert_eq!((d.lines, d.estimate.comm_ms), (bf16.lines, bf16.estimate.comm_ms), "m {m}");
            assert!(d.estimate.compute_ms < bf16.estimate.compute_ms, "m {m}");
            let wide = decide(&f, &Shape { out_bytes: 4, ..fp8 }, true, None).unwrap();
            assert!(wide.estimate.comm_ms > 1.9 * (d.estimate.comm_ms - 2.0 * DeviceModel::HOPPER.barrier_us / 1e3));
        }
    }

    #[test]
    fn the_call_s_option_beats_the_group_s_setting() {
        let s = shape(Op::AgMm, 2048, 8192, 14336);
        let env = hopper(2, Some(Algorithm::Sequential));
        let d = decide(&env, &s, true, None).unwrap();
        assert_eq!((d.algorithm, d.why), (Algorithm::Sequential, Why::Env));
        let d = decide(&env, &s, true, Some(Algorithm::Fused)).unwrap();
        assert_eq!((d.algorithm, d.why), (Algorithm::Fused, Why::Option));
        assert_eq!(d.estimate.algorithm, Algorithm::Fused);
    }

    #[test]
    fn a_forced_fused_call_that_cannot_fuse_is_unsupported() {
        let s = shape(Op::MmRs, 512, 14336, 8192);
        let e = decide(&hopper(2, None), &s, false, Some(Algorithm::Fused)).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Unsupported);
        assert!(e.msg.contains("options ask for the fused algorithm"), "{}", e.msg);
        let host = Facts { caps: Capabilities::default(), ..hopper(2, Some(Algorithm::Fused)) };
        let e = decide(&host, &s, true, None).unwrap_err();
        assert!(e.msg.starts_with("SYMM_ALGO=fused"), "{}", e.msg);
    }

    #[test]
    fn all_reduce_is_one_shot_when_small_and_two_shot_when_large() {
        let f = hopper(2, None);
        let pick = |bytes: usize| decide_all_reduce(&f, bytes / 2, DType::BF16, None).algorithm;
        for small in [2, 8 << 10, 64 << 10, 256 << 10] {
            assert_eq!(pick(small), AllReduceAlgorithm::OneShot, "{small} bytes");
        }
        for large in [4 << 20, 16 << 20, 256 << 20] {
            assert_eq!(pick(large), AllReduceAlgorithm::TwoShot, "{large} bytes");
        }
        // More ranks move the one-shot's message more often: it gives way sooner.
        let at = |world: usize| {
            let f = hopper(world, None);
            (1..64)
                .map(|i| i << 16)
                .find(|&b| decide_all_reduce(&f, b / 2, DType::BF16, None).algorithm == AllReduceAlgorithm::TwoShot)
        };
        assert!(at(8).unwrap() <= at(2).unwrap());
        let forced = decide_all_reduce(&f, 1, DType::F32, Some(AllReduceAlgorithm::TwoShot));
        assert_eq!((forced.algorithm, forced.why), (AllReduceAlgorithm::TwoShot, Why::Option));
        assert_eq!(
            decide_all_reduce(&hopper(1, None), 1 << 30, DType::F32, None).algorithm,
            AllReduceAlgorithm::OneShot
        );
    }

    #[test]
    fn lc_allgather_takes_the_lines_when_small_on_own_devices() {
        let path = |facts: &Facts, bytes: usize| decide_lc_allgather(facts, bytes, None).unwrap().path;
        let f = hopper(2, None);
        for small in [1, 64 << 10, 256 << 10, 2 << 20] {
            assert_eq!(path(&f, small), GatherPath::Lines, "{small} bytes");
        }
        for large in [8 << 20, 256 << 20] {
            assert_eq!(path(&f, large), GatherPath::CopyEngines, "{large} bytes");
        }
        // Nothing to move, one rank, ranks sharing a device (every host
        // rank), more ranks than the kernel takes, no kernel: the copy engines.
        let shared = Facts { own_devices: false, ..f };
        let host = Facts { caps: Capabilities { all_gather: false, ..f.caps }, ..f };
        for facts in [shared, host, hopper(1, None), hopper(AllReduceLayout::MAX_WORLD + 1, None)] {
            assert_eq!(path(&facts, 64 << 10), GatherPath::CopyEngines, "{facts:?}");
        }
        assert_eq!(path(&f, 0), GatherPath::CopyEngines);
        // Forced: either path where the kernel exists, whatever the size;
        // the lines refused without it.
        let d = decide_lc_allgather(&shared, 1 << 30, Some(GatherPath::Lines)).unwrap();
        assert_eq!((d.path, d.why), (GatherPath::Lines, Why::Option));
        let d = decide_lc_allgather(&f, 8, Some(GatherPath::CopyEngines)).unwrap();
        assert_eq!(d.path, GatherPath::CopyEngines);
        let e = decide_lc_allgather(&host, 8, Some(GatherPath::Lines)).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Unsupported);
        let many = hopper(AllReduceLayout::MAX_WORLD + 1, None);
        assert!(decide_lc_allgather(&many, 8, Some(GatherPath::Lines)).is_err());
    }

    #[test]
    fn world_one_may_force_pipelined_and_reports_an_estimate() {
        let d = decide(&hopper(1, None), &shape(Op::AgMm, 64, 64, 64), true, Some(Algorithm::Pipelined)).unwrap();
        assert_eq!(d.algorithm, Algorithm::Pipelined);
        assert_eq!(d.estimate.algorithm, Algorithm::Sequential);
    }

    /// The level inside a host takes the lines for small steps only, the
    /// reduce-scatter (whose lines wait for the later rank) up to smaller
    /// ones than the gather; never alone on a host, past the kernels'
    /// world, or on shared devices.
    #[test]
    fn inside_a_host_small_steps_take_the_lines() {
        let facts = Facts {
            caps: Capabilities { all_gather: true, ..Capabilities::default() },
            own_devices: true,
            ..crate::ops::testing::host_facts(8)
        };
        for local in [2, 4, 8] {
            for step in [InsideStep::AllGather, InsideStep::ReduceScatter] {
                assert!(inside_on_lines(&facts, local, step, 4 << 10), "{step:?} 4 KiB over {local}");
                assert!(!inside_on_lines(&facts, local, step, 16 << 20), "{step:?} 16 MiB over {local}");
                assert!(!inside_on_lines(&facts, local, step, 0));
            }
        }
        let gather = |b| inside_on_lines(&facts, 2, InsideStep::AllGather, b);
        let scatter = |b| inside_on_lines(&facts, 2, InsideStep::ReduceScatter, b);
        assert!(gather(512 << 10) && !scatter(512 << 10));
        assert!(!inside_on_lines(&facts, 1, InsideStep::AllGather, 4 << 10));
        assert!(!inside_on_lines(&facts, AllReduceLayout::MAX_WORLD + 1, InsideStep::AllGather, 4 << 10));
        let shared = Facts { own_devices: false, ..facts };
        assert!(!inside_on_lines(&shared, 2, InsideStep::AllGather, 4 << 10));
        let no_kernel = Facts { caps: Capabilities::default(), ..facts };
        assert!(!inside_on_lines(&no_kernel, 2, InsideStep::AllGather, 4 << 10));
    }

    /// Across hosts, matmuls are split to overlap their communication from
    /// where a piece's matmul is compute-bound (about 370 rows of bf16,
    /// 320 of fp8), never at decode sizes.
    #[test]
    fn across_hosts_overlap_from_compute_bound_pieces() {
        for rows in [16, 64, 256, 320] {
            assert!(!across_hosts_overlap(rows, DType::BF16), "{rows}");
        }
        for rows in [384, 512, 4096, 8192] {
            assert!(across_hosts_overlap(rows, DType::BF16), "{rows}");
        }
        assert!(!across_hosts_overlap(256, DType::F8E4M3) && across_hosts_overlap(384, DType::F8E4M3));
        assert!(!across_hosts_overlap(512, DType::F32) && across_hosts_overlap(768, DType::F32));
    }

    /// Devices are told apart by host: GPU 0 of two hosts is two devices.
    #[test]
    fn own_devices_count_each_host_s_devices() {
        let on = |p: &[(usize, i32)]| all_distinct(p.iter().map(|&(h, d)| (Some(h), d)));
        assert!(on(&[(0, 0), (0, 1), (1, 0), (1, 1)]));
        assert!(!on(&[(0, 0), (0, 0), (1, 1)]));
        assert!(on(&[(0, 0), (1, 0)]));
    }
}
