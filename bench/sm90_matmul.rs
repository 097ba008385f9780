//! symm's sm90 matmul against cuBLASLt on the benchmark's matmul shapes
//! (bf16 and fp8) on GPU 0, printing one JSON record per shape and
//! implementation, which bench/gpu/collect.py gathers from the run's log.
//! With `--candidates`, also every algorithm cuBLASLt's heuristic offers for
//! the pipelined paths' matmuls at M = 512 (op "matmul_candidate").
//!
//!   cargo run --release --example sm90_matmul [-- MxKxN ...] [--no-fp8] [--candidates]
//!
//! Shapes as MxKxN pick some of the benchmark's (for profilers); none: all.
use symm::bench_support;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
        bench_support::heuristic_candidates();
    }
}
