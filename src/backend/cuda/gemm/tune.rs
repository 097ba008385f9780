//! Choosing among cuBLASLt's algorithms by timing them. Its heuristic's
//! first choice can be far from its best:
//! - with few rows (a decode step's), bound by reading B, it may leave
//!   SMs without tiles: on an H200 another candidate ran 7-8% faster for
//!   64 rows against B of 8192 x 14336 either way round, 5% for 16 rows
//!   against 14336 x 8192;
//! - at some row counts it picks tiles that run 1.2-1.45 x the time its
//!   pick for a few more rows takes (H200, torch's cuBLAS alike: 690-700
//!   rows against B of 14336 x 7168 in 261-275 us, 750 rows in 205; 448
//!   rows against 5120 x 3072 in 34.5 us, 512 in 24.0;
//!   `bench/probes/matmul_rows_probe.py`). A pipelined path's pieces hit
//!   such counts as often as whole matmuls do.
//!
//! The candidates run once per shape, on the first call outside graph
//! capture: on the call's own stream, with its own operands, workspace
//! and output (which the call itself then overwrites, so nothing else is
//! written). The host waits for them, at most [`WAIT`]; where they have
//! not finished by then (the stream is behind other work), the first
//! choice stays and a later call tries again, [`ATTEMPTS`] times in all.
//! A device spends at most [`BUDGET_MS`] on trials in its life (their
//! estimated cost, [`cost_ms`]): many small shapes, or a few dozen of the
//! largest.

use super::lt_matmul::{set_fp8_pointers, LtMatmul, MatmulKey, Operands, Pref};
use super::params::MatmulParams;
use crate::backend::cuda::event::Event;
use crate::backend::Stream;
use crate::error::Result;
use cudarc::cublaslt::sys as lt;
use std::time::{Duration, Instant};

/// Decode sizes: at most this many rows of A (the caller's m) ...
pub(super) const MAX_ROWS: usize = 256;
/// ... and at least this many bytes of B: a smaller matmul takes a few
/// microseconds whatever its algorithm.
pub(super) const MIN_B_BYTES: usize = 16 << 20;
/// Other sizes: at least this much work (about 5 us on a Hopper GPU) ...
pub(super) const MIN_FLOPS: f64 = 4e9;
/// ... and at most this much (about 0.7 ms): the trial of a larger one
/// would take longer than [`WAIT`], and the first choices measured there
/// were within a few percent of the best.
pub(super) const MAX_FLOPS: f64 = 5e11;
/// What a device's trials may cost in all (ms, [`cost_ms`]): a program
/// running many row counts (prefills of every length) pays for the first
/// ones only. About 65 trials of the largest timed matmul, or over two
/// thousand of the smallest: a count of shapes instead (64 once) left a
/// run of 171 small ones with cuBLAS's slow first choices after the 64th
/// (4096 x 7168 at 642 rows 80 us, against 53 at 578 rows; H200,
/// bench/results/2026-12-01-h200-0c41640-small-n-rows).
pub(super) const BUDGET_MS: f64 = 3000.0;
/// A trial's host time beside its launches' GPU time (the heuristic's
/// query, the events, issuing the launches), ms.
const TRIAL_HOST_MS: f64 = 1.0;
/// The rates a trial's launches are estimated at: a Hopper GPU's 16-bit
/// matmul rate (fp8 twice it) and its memory bandwidth.
const TFLOPS: f64 = 800.0;
const HBM_GBPS: f64 = 4000.0;
/// The heuristic's first candidates timed.
pub(super) const CANDIDATES: usize = 8;
/// Rounds over the candidates, each round starting one candidate later
/// (the GPU's clock drifts as it heats, which would favour a place in
/// the order).
const ROUNDS: usize = 3;
/// Launches of a candidate timed in a round, after one that is not: B
/// is far larger than L2, but its last part stays there for the next
/// launch, which would favour a candidate that reads B in another order
/// than the one before it. Behind its own launch a candidate finds L2
/// as in use: holding what it does not read first.
const TIMED_LAUNCHES: usize = 2;
/// Another candidate replaces the first choice only when this much faster
/// (the median of its rounds): the heuristic's pick stands where the
/// timing cannot tell them apart.
const MIN_GAIN: f32 = 0.02;
/// How long the host waits for the candidates' launches.
const WAIT: Duration = Duration::from_millis(100);
/// Tries before the first choice stays for good.
const ATTEMPTS: u8 = 3;
/// How often the host looks while it waits.
const POLL: Duration = Duration::from_micros(50);

/// Where a cached matmul stands with the timing of its candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tuning {
    /// To try (the number of tries that found no answer in time).
    Pending(u8),
    /// A call is timing the candidates now.
    Running,
    /// Settled: the fastest candidate, or the first choice for good.
    Done,
}

impl Tuning {
    /// The state after a try that found no answer in time.
    pub(super) fn retry(tries: u8) -> Tuning {
        if tries + 1 >= ATTEMPTS {
            Tuning::Done
        } else {
            Tuning::Pending(tries + 1)
        }
    }
}

/// Whether `p` is a matmul whose candidates are worth timing: one matrix,
/// an output the candidates may overwrite (not accumulated into), and
/// either few rows against a large B or work between [`MIN_FLOPS`] and
/// [`MAX_FLOPS`].
pub(super) fn worth_it(p: &MatmulParams) -> bool {
    let b_bytes = p.k.saturating_mul(p.n).saturating_mul(p.operand_size() as usize);
    let flops = 2.0 * p.m as f64 * p.k as f64 * p.n as f64;
    let decode = p.m <= MAX_ROWS && b_bytes >= MIN_B_BYTES;
    p.batch == 1 && !p.accumulate && (decode || (MIN_FLOPS..=MAX_FLOPS).contains(&flops))
}

/// The estimated cost (ms) of timing `p`'s candidates: every launch of
/// the trial at the larger of its matmul's compute and memory times (C
/// counted at 4 bytes an element, at most its size), and the host's part.
pub(super) fn cost_ms(p: &MatmulParams) -> f64 {
    let size = p.operand_size() as f64;
    let (m, k, n) = (p.m as f64, p.k as f64, p.n as f64);
    let tflops = if p.operand_size() == 1 { 2.0 * TFLOPS } else { TFLOPS };
    let compute = 2.0 * m * k * n / (tflops * 1e9);
    let memory = ((m * k + k * n) * size + m * n * 4.0) / (HBM_GBPS * 1e6);
    let launches = (ROUNDS * CANDIDATES * (1 + TIMED_LAUNCHES)) as f64;
    launches * compute.max(memory) + TRIAL_HOST_MS
}

/// Launches the timing of `matmul`'s candidates (the heuristic's first
/// [`CANDIDATES`] for `key`) with `p`'s operands on `stream`; None where
/// the heuristic offers one alone.
pub(super) fn start(
    handle: lt::cublasLtHandle_t,
    matmul: &LtMatmul,
    key: &MatmulKey,
    p: &MatmulParams,
    operands: Operands,
    stream: Stream,
) -> Result<Option<Trial>> {
    let candidates = matmul.heuristic(handle, &Pref::new(key)?, CANDIDATES)?;
    if candidates.len() < 2 {
        return Ok(None);
    }
    if let Some(f) = &p.fp8 {
        set_fp8_pointers(matmul.desc, f)?;
    }
    // Into the call's own C, which the call itself overwrites next.
    let run = |algo: &lt::cublasLtMatmulAlgo_t| matmul.run(handle, algo, operands, p.alpha, false, stream);
    Trial::launch(candidates, stream, run).map(Some)
}

/// The candidate a trial keeps.
pub(super) struct Kept {
    pub(super) algo: lt::cublasLtMatmulAlgo_t,
    /// Its place in the heuristic's order (0: the first choice), of `of`.
    pub(super) index: usize,
    pub(super) of: usize,
    /// Its and the first choice's median ms.
    pub(super) ms: f32,
    pub(super) first_ms: f32,
}

/// The candidates' launches on one stream: per round and candidate, an
/// untimed launch, then [`TIMED_LAUNCHES`] between two events.
pub(super) struct Trial {
    candidates: Vec<lt::cublasLtMatmulAlgo_t>,
    /// The candidate of each timed group, with its start and end events.
    groups: Vec<(usize, Event, Event)>,
}

impl Trial {
    /// Enqueues every round's launches on `stream`; `run` launches one
    /// candidate.
    pub(super) fn launch(
        candidates: Vec<lt::cublasLtMatmulAlgo_t>,
        stream: Stream,
        mut run: impl FnMut(&lt::cublasLtMatmulAlgo_t) -> Result<()>,
    ) -> Result<Trial> {
        let n = candidates.len();
        let mut groups = Vec::with_capacity(ROUNDS * n);
        for c in (0..ROUNDS).flat_map(|r| (0..n).map(move |i| (i + r) % n)) {
            let (start, end) = (Event::timing()?, Event::timing()?);
            run(&candidates[c])?;
            start.record(stream)?;
            for _ in 0..TIMED_LAUNCHES {
                run(&candidates[c])?;
            }
            end.record(stream)?;
            groups.push((c, start, end));
        }
        Ok(Trial { candidates, groups })
    }

    /// Waits for the launches, at most [`WAIT`]: the candidate to keep, or
    /// None where they had not finished.
    pub(super) fn fastest(&self) -> Result<Option<Kept>> {
        let deadline = Instant::now() + WAIT;
        let Some((_, _, last)) = self.groups.last() else { return Ok(None) };
        while !last.done()? {
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(POLL);
        }
        let mut samples = vec![Vec::new(); self.candidates.len()];
        for (c, start, end) in &self.groups {
            samples[*c].push(start.ms_to(end)? / TIMED_LAUNCHES as f32);
        }
        let medians: Vec<f32> = samples.iter_mut().map(|v| median(v)).collect();
        let index = choose(&medians);
        Ok(Some(Kept {
            algo: self.candidates[index],
            index,
            of: medians.len(),
            ms: medians[index],
            first_ms: medians[0],
        }))
    }
}

fn median(v: &mut [f32]) -> f32 {
    v.sort_by(f32::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f32::INFINITY)
}

/// The index to keep of candidates whose times are `medians`, the first
/// being the heuristic's choice: the fastest, where it gains at least
/// [`MIN_GAIN`] on the first.
fn choose(medians: &[f32]) -> usize {
    let best = (0..medians.len()).min_by(|&a, &b| medians[a].total_cmp(&medians[b])).unwrap_or(0);
    if medians[best] <= medians[0] * (1.0 - MIN_GAIN) {
        best
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::gemm::GemmDtype;

    #[test]
    fn decode_and_mid_sized_matmuls_are_timed() {
        // B of 8192 x 14336 bf16 (224 MiB) against 16 to 256 rows: decode.
        let p = |m| MatmulParams::new(m, 14336, 8192, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        for m in [1, 16, 64, 256] {
            assert!(worth_it(&p(m)), "{m} rows");
        }
        // Mid-sized: 690 rows (a pipelined piece), up to the work bound.
        assert!(worth_it(&p(690)) && worth_it(&p(2000)));
        assert!(!worth_it(&p(2200)), "more than MAX_FLOPS: the trial would outlast WAIT");
        let mut q = p(64);
        q.accumulate = true;
        assert!(!worth_it(&q), "an accumulated output cannot take the candidates' writes");
        q = p(64);
        (q.batch, q.stride_a, q.stride_c) = (2, 64 * 8192, 64 * 14336);
        assert!(!worth_it(&q), "batched");
        // Decode rows against B just under and at the bound.
        let small = MatmulParams::new(64, 1024, MIN_B_BYTES / 2048 - 1, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        assert!(!worth_it(&small));
        let at = MatmulParams::new(64, 1024, MIN_B_BYTES / 2048, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        assert!(worth_it(&at));
        // More rows against a small B: timed from MIN_FLOPS of work.
        let rows = |m| MatmulParams::new(m, 1024, 1024, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        assert!(!worth_it(&rows(1024)) && worth_it(&rows(2048)));
    }

    /// The budget holds dozens of the largest trials and thousands of the
    /// smallest; a decode trial costs a few ms.
    #[test]
    fn the_budget_counts_each_trial_s_cost() {
        let largest = MatmulParams::new(2000, 14336, 8192, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        assert!(worth_it(&largest) && 2.0 * 2000.0 * 14336.0 * 8192.0 > 0.9 * MAX_FLOPS);
        let trials = |p: &MatmulParams| BUDGET_MS / cost_ms(p);
        assert!((50.0..80.0).contains(&trials(&largest)), "{}", trials(&largest));
        let smallest = MatmulParams::new(2048, 1024, 1024, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        assert!(worth_it(&smallest) && trials(&smallest) > 2000.0, "{}", trials(&smallest));
        let decode = MatmulParams::new(64, 14336, 8192, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        let ms = cost_ms(&decode);
        assert!(worth_it(&decode) && (3.0..8.0).contains(&ms), "{ms}");
    }

    #[test]
    fn another_candidate_must_gain_enough() {
        assert_eq!(choose(&[1.0, 0.99, 1.2]), 0, "1% is within the timing's noise");
        assert_eq!(choose(&[1.0, 1.1, 0.95]), 2);
        assert_eq!(choose(&[0.9, 1.0, 0.95]), 0, "the first is the fastest");
        assert_eq!(choose(&[1.0]), 0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    }

    #[test]
    fn tries_end_after_the_attempts() {
        let mut state = Tuning::Pending(0);
        let mut tries = 0;
        while let Tuning::Pending(n) = state {
            state = Tuning::retry(n);
            tries += 1;
        }
        assert_eq!((state, tries), (Tuning::Done, ATTEMPTS as usize));
    }
}
