//! The host backend: the same contract as CUDA, on CPUs. Symmetric memory is
//! a memfd mapped shared by every rank; signals are atomics in those maps.
//! Operations complete before they return, so streams are ignored; the
//! data-moving primitives are strided loops and the `gemm` crate (fp8
//! decoded to f32 first).

pub(crate) mod elementwise;
mod gather;
pub(crate) mod matmul;
mod memory;
mod scaled;
mod signals;

use super::{
    AddRmsNorm, AllGatherCall, Allocation, Backend, BackendKind, Capabilities, GemmScales, Mapping, PadSet, Quantize,
    ReduceScatterCall, Signals, Stream,
};
use crate::array::Array;
use crate::error::Result;
use crate::health::Health;
use std::os::fd::OwnedFd;
use std::sync::Arc;

pub use memory::{HostAllocation, HostMapping};

pub struct HostBackend {
    /// The group's health: waits end as soon as the group fails.
    health: Arc<Health>,
}

impl HostBackend {
    pub fn new(health: Arc<Health>) -> Self {
        HostBackend { health }
    }
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }
    /// No fused kernel: the operations run their sequential and pipelined
    /// forms over `copy`, `reduce` and `gemm`. The all-gather runs the
    /// kernel's protocol on the CPU (taken where a call forces it: the
    /// ranks share the host, so the automatic choice is the copies).
    fn capabilities(&self) -> Capabilities {
        Capabilities { all_gather: true, ..Capabilities::default() }
    }
    fn device(&self) -> i32 {
        -1
    }
    fn granularity(&self) -> usize {
        memory::page_size()
    }
    fn allocate(&self, bytes: usize) -> Result<Box<dyn Allocation>> {
        Ok(Box::new(HostAllocation::new(bytes)?))
    }
    fn import(&self, fd: OwnedFd, bytes: usize) -> Result<Box<dyn Mapping>> {
        Ok(Box::new(HostMapping::import(fd, bytes)?))
    }
    fn signals(&self, pads: PadSet) -> Result<Box<dyn Signals>> {
        Ok(Box::new(signals::HostSignals::new(pads, self.health.clone())))
    }
    fn copy(&self, dst: &Array, src: &Array, _stream: Stream) -> Result<()> {
        super::check_copy(dst, src)?;
        elementwise::copy(dst, src)
    }
    fn reduce(&self, dst: &Array, srcs: &[Array], scale: f32, _stream: Stream) -> Result<()> {
        elementwise::reduce(dst, srcs, scale)
    }
    fn reduce_integers(&self, dst: &Array, srcs: &[Array], divisor: usize, _stream: Stream) -> Result<()> {
        elementwise::reduce_integers(dst, srcs, divisor)
    }
    fn gemm(&self, dst: &Array, a: &Array, b: &Array, accumulate: bool, _stream: Stream) -> Result<()> {
        matmul::gemm(dst, a, b, accumulate)
    }
    fn scaled_gemm(
        &self,
        dst: &Array,
        a: &Array,
        b: &Array,
        scales: &GemmScales,
        accumulate: bool,
        _stream: Stream,
    ) -> Result<()> {
        scaled::scaled_gemm(dst, a, b, scales, accumulate)
    }
    fn all_gather(&self, call: &AllGatherCall, _stream: Stream) -> Result<()> {
        gather::all_gather(call, &self.health)
    }
    fn reduce_scatter(&self, call: &ReduceScatterCall, _stream: Stream) -> Result<()> {
        gather::reduce_scatter(call, &self.health)
    }
    fn add_rms_norm(&self, norm: &AddRmsNorm, _stream: Stream) -> Result<()> {
        elementwise::add_rms_norm(norm)
    }
    fn check_scaled_gemm(&self, _row_wise: bool) -> Result<()> {
        Ok(())
    }
    fn quantize(&self, q: &Quantize, _stream: Stream) -> Result<()> {
        scaled::quantize(q)
    }
}
