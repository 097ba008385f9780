//! Bandwidth of symm's copy kernels on GPU 0: the strided pack and the
//! reduction (local sources, and a local plus a peer GPU's buffer where
//! there are two GPUs). Prints one line per case.
//!
//!   cargo run --release --example copy_kernels
use symm::bench_support;

fn main() {
    bench_support::pack_bandwidth();
    bench_support::reduce_bandwidth();
}
