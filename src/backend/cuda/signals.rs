//! Stream-ordered signals on CUDA: tiny kernels (kernels/signal.cu) that
//! spin on the pads with system-scope atomics and a `%globaltimer` timeout.
//! A timeout, or another call's tag where a wait expected its own, is
//! recorded in the group's async error record, not returned here: the
//! launch has long returned by then.

use super::async_error::AsyncError;
use super::device_bytes::DeviceBytes;
use super::driver::check;
use super::module::{arg, Kernels};
use crate::backend::{CallTag, PadSet, Signals, Stream, SIGNAL_CHANNELS};
use crate::error::{err, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

pub struct CudaSignals {
    ctx: Arc<CudaContext>,
    kernels: Arc<Kernels>,
    errors: Arc<AsyncError>,
    /// Device array of the pads' addresses, `world` u64s, filled by the
    /// backend before the signals are handed out.
    pads: DeviceBytes,
    rank: usize,
    world: usize,
    /// `reaches[r]`: rank r's pad is mapped here (see `PadSet::pads`).
    reaches: Vec<bool>,
}

// SAFETY: device pointers and function handles are process-wide.
unsafe impl Send for CudaSignals {}
unsafe impl Sync for CudaSignals {}

impl CudaSignals {
    pub fn new(ctx: Arc<CudaContext>, kernels: Arc<Kernels>, errors: Arc<AsyncError>, pads: PadSet) -> Result<Self> {
        let dev = DeviceBytes::new(pads.pads.len() * 8)?;
        let reaches = (0..pads.world).map(|r| pads.reaches(r)).collect();
        Ok(CudaSignals { ctx, kernels, errors, pads: dev, rank: pads.rank, world: pads.world, reaches })
    }

    /// The device array of pad addresses, for the backend to fill.
    pub fn pads_table(&self) -> u64 {
        self.pads.addr
    }

    fn check_peer(&self, peer: usize, channel: usize) -> Result<()> {
        if peer >= self.world || peer == self.rank {
            return Err(err!(
                InvalidArgument,
                "peer {peer} is not another rank of this group of {} (this is rank {})",
                self.world,
                self.rank
            ));
        }
        if !self.reaches[peer] {
            return Err(err!(Unsupported, "rank {peer} is on another host: its signal pad is not mapped here"));
        }
        check_channel(channel)
    }

    fn launch(&self, f: &CudaFunction, block: u32, stream: Stream, params: &mut [*mut c_void]) -> Result<()> {
        // A wait may already have failed: report it instead of queueing more.
        self.errors.check()?;
        // SAFETY: the parameters match the kernel's signature (kernels/signal.cu)
        // and live until the launch returns.
        unsafe { self.kernels.launch(f, 1, (block, 1, 1), stream, params, "a signal kernel") }
    }
}

impl CudaSignals {
    /// `symm_put_signal` or `symm_wait_signal` (same parameters) for one peer.
    fn point_to_point(
        &self,
        f: &CudaFunction,
        peer: usize,
        channel: usize,
        tag: CallTag,
        stream: Stream,
        timeout: Duration,
    ) -> Result<()> {
        self.check_peer(peer, channel)?;
        let (mut pads, mut rank, mut world) = (self.pads.addr, self.rank as i32, self.world as i32);
        let (mut peer, mut channel, mut tag, mut t, mut e) =
            (peer as i32, channel as i32, tag.get(), nanos(timeout), self.errors.device_ptr());
        let mut params = [
            arg(&mut pads),
            arg(&mut rank),
            arg(&mut world),
            arg(&mut peer),
            arg(&mut channel),
            arg(&mut tag),
            arg(&mut t),
            arg(&mut e),
        ];
        self.launch(f, 1, stream, &mut params)
    }
}

fn check_channel(channel: usize) -> Result<()> {
    if channel >= SIGNAL_CHANNELS {
        return Err(err!(InvalidArgument, "channel {channel} is out of range (0..{SIGNAL_CHANNELS})"));
    }
    Ok(())
}

fn nanos(t: Duration) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1)
}

impl Signals for CudaSignals {
    fn put(&self, peer: usize, channel: usize, tag: CallTag, stream: Stream, timeout: Duration) -> Result<()> {
        self.point_to_point(&self.kernels.put_signal, peer, channel, tag, stream, timeout)
    }

    fn wait(&self, peer: usize, channel: usize, tag: CallTag, stream: Stream, timeout: Duration) -> Result<()> {
        self.point_to_point(&self.kernels.wait_signal, peer, channel, tag, stream, timeout)
    }

    fn barrier(&self, channel: usize, tag: CallTag, stream: Stream, timeout: Duration) -> Result<()> {
        check_channel(channel)?;
        if self.world == 1 {
            return Ok(());
        }
        let block = (self.world as u32).div_ceil(32) * 32;
        let (mut pads, mut rank, mut world) = (self.pads.addr, self.rank as i32, self.world as i32);
        let (mut channel, mut tag, mut t, mut e) =
            (channel as i32, tag.get(), nanos(timeout), self.errors.device_ptr());
        let mut params = [
            arg(&mut pads),
            arg(&mut rank),
            arg(&mut world),
            arg(&mut channel),
            arg(&mut tag),
            arg(&mut t),
            arg(&mut e),
        ];
        self.launch(&self.kernels.barrier, block, stream, &mut params)
    }

    fn write_value(&self, addr: u64, value: u32, stream: Stream) -> Result<()> {
        self.errors.check()?;
        self.ctx.bind_to_thread().map_err(|e| super::driver::cuda_err(e, "making the context current"))?;
        // Default flags order the write after the stream's earlier work
        // (memory barrier included), which is what a flag must publish.
        // SAFETY: addr lies in a VMM mapping (checked by the caller).
        check(
            unsafe { sys::cuStreamWriteValue32_v2(stream.0 as sys::CUstream, addr, value, 0) },
            "cuStreamWriteValue32",
        )
    }

    fn wait_value(&self, addr: u64, value: u32, owner: usize, stream: Stream, timeout: Duration) -> Result<()> {
        let (mut flag, mut value, mut rank, mut owner) = (addr, value, self.rank as i32, owner as i32);
        let (mut t, mut e) = (nanos(timeout), self.errors.device_ptr());
        let mut params = [arg(&mut flag), arg(&mut value), arg(&mut rank), arg(&mut owner), arg(&mut t), arg(&mut e)];
        self.launch(&self.kernels.wait_value, 1, stream, &mut params)
    }
}
