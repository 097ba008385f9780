//! symm's sm90 matmul against cuBLASLt on the benchmark's matmul shapes
//! (bf16 and fp8) on GPU 0, printing one JSON record per shape and
//! implementation, which bench/gpu/collect.py gathers from the run's log.
//! With `--candidates`, also every algorithm cuBLASLt's heuristic offers for
//! the pipelined paths' matmuls at M = 512 (op "matmul_candidate");
//! `--candidates=MxKxN,...` times those shapes' candidates alone.
//!
//!   cargo run --release --example sm90_matmul [-- MxKxN ...] [--no-fp8] [--candidates[=MxKxN,...]]
//!
//! Shapes as MxKxN pick some of the benchmark's (for profilers); none: all.
use symm::bench_support;

/// (m, n, k): mm_rs 512x14336x8192's chunks and whole; ag_mm 512x8192x14336's.
const CANDIDATE_SHAPES: [(usize, usize, usize); 4] =
    [(256, 8192, 14336), (512, 8192, 14336), (256, 14336, 8192), (512, 14336, 8192)];

/// "MxKxN" as (m, n, k).
fn parse_shape(s: &str) -> (usize, usize, usize) {
    let d: Vec<usize> = s.split('x').map(|v| v.parse().expect("MxKxN: whole numbers")).collect();
    assert_eq!(d.len(), 3, "a shape is MxKxN, not {s}");
    (d[0], d[2], d[1])
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(list) = args.iter().find_map(|a| a.strip_prefix("--candidates=")) {
        let shapes: Vec<_> = list.split(',').map(parse_shape).collect();
        bench_support::heuristic_candidates(&shapes);
        return;
    }
    let named: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let shapes: Vec<(usize, usize, usize)> = bench_support::SHAPES
        .iter()
        .copied()
        .filter(|&(m, n, k)| named.is_empty() || named.iter().any(|s| **s == format!("{m}x{k}x{n}")))
        .collect();
    bench_support::sm90_matmul(&shapes);
    if !args.iter().any(|a| a == "--no-fp8") {
        bench_support::sm90_fp8(&shapes);
    }
    if args.iter().any(|a| a == "--candidates") {
        bench_support::heuristic_candidates(&CANDIDATE_SHAPES);
    }
}
