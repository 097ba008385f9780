//! Timing runs of symm's own kernels for the benchmark programs under
//! bench/ (`cargo run --release --example sm90_matmul`, `copy_kernels`). Not an API: hidden
//! from the docs, and it may change with the benchmarks.

pub use crate::backend::cuda::sm90::bench::{print_record, sm90_fp8, sm90_matmul, SHAPES};

/// Every algorithm cuBLASLt's heuristic offers for each `(m, n, k)`,
/// timed round-robin against its first choice.
pub fn heuristic_candidates(shapes: &[(usize, usize, usize)]) {
    crate::backend::cuda::gemm::bench_heuristic_candidates(shapes)
}

/// Bandwidth of the strided pack (copy) kernels on GPU 0.
pub fn pack_bandwidth() {
    crate::backend::cuda::pack::bench_pack_bandwidth()
}

/// Bandwidth of the reduction kernel: local sources, then a local and a
/// peer GPU's buffer (where there are two GPUs).
pub fn reduce_bandwidth() {
    crate::backend::cuda::reduce::bench_reduce_bandwidth();
    crate::backend::cuda::reduce::bench_reduce_peer_bandwidth();
}
