//! The contract every memory backend fulfils, so that groups, rendezvous
//! and the operations are written once.
//!
//! A backend allocates exportable memory (a POSIX fd names it), maps peers'
//! allocations from their fds, and implements stream-ordered signals over the
//! signal pads of a rendezvoused set of allocations. Addresses are `u64` in
//! the backend's address space: host virtual addresses for `host`, device
//! virtual addresses for `cuda`.

pub mod cuda;
pub mod host;

use crate::array::{Array, DType};
use crate::error::{err, Result};
use crate::health::Health;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

/// What [`Backend::run_repeatable`] knows a call by: its exact description
/// (about a kilobyte) and that text's hash, made once, so that a kept call,
/// which reuses its key, is looked up without hashing or copying the text.
#[derive(Clone, Debug)]
pub struct ReplayKey(Arc<(u64, String)>);

impl ReplayKey {
    pub fn new(text: String) -> ReplayKey {
        let mut h = DefaultHasher::new();
        text.hash(&mut h);
        ReplayKey(Arc::new((h.finish(), text)))
    }

    pub fn text(&self) -> &str {
        &self.0 .1
    }
}

impl PartialEq for ReplayKey {
    fn eq(&self, other: &ReplayKey) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || *self.0 == *other.0
    }
}

impl Eq for ReplayKey {}

impl Hash for ReplayKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0 .0);
    }
}

/// What a call's signals, lines and fused reduce-scatter flags carry
/// besides the call's number: a hash of the arguments every rank agreed
/// on, so that ranks that go on to make different calls (each kept
/// before, so neither exchanges arguments) fail with `Mismatch` at their
/// first meeting instead of succeeding on each other's data. The LL
/// kernels and the host backend stop before they read that data; on CUDA
/// the copies queued behind a signal wait and the fused kernel's sums
/// still run, so that call's outputs are undefined and the failure
/// arrives with the group's next call or `health`. Calls of one signature
/// (the same shapes, dtypes and options on other tensors) share a tag: as
/// in NCCL, such calls are matched by their order alone. Never 0 (a free
/// signal slot); [`CallTag::USER`] for the public API's signals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallTag(u32);

impl CallTag {
    /// Signals a user's program sends (`symm_put_signal`, `symm_barrier`),
    /// which no operation's tag equals.
    pub const USER: CallTag = CallTag(1);

    /// The tag of an operation whose agreed signature encodes to `bytes`
    /// (FNV-1a, kept away from 0 and `USER`).
    pub fn of(bytes: &[u8]) -> CallTag {
        let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let folded = (h ^ (h >> 32)) as u32;
        CallTag(if folded < 2 { folded + 2 } else { folded })
    }

    pub fn get(self) -> u32 {
        self.0
    }

    /// A tag as `get` returned it (received from a peer).
    pub fn from_raw(tag: u32) -> CallTag {
        CallTag(tag)
    }

    /// The error of a rank that met `peer` in another call: `at` says where
    /// (ending in ": "), `tags` are the peer's and this rank's where known.
    pub fn mismatch(at: &str, peer: usize, tags: Option<(CallTag, CallTag)>) -> crate::error::Error {
        let which = match tags {
            Some((found, own)) => format!("call tag {:#010x}, this rank's {:#010x}", found.0, own.0),
            None => "another call tag".to_string(),
        };
        err!(
            Mismatch,
            "{at}rank {peer} is making a different call from this rank's ({which}): the ranks' arguments differ \
             although each call was agreed before; SYMM_CHECK_ARGS=always compares every call's arguments and \
             names them"
        )
    }
}

/// [`Backend::check_tags`]'s arguments: `count` `u32` tags at `tags` (device
/// memory), the members' group ranks at `ranks` (`count` `i32`s), and this
/// rank's `tag` and group `rank`.
#[derive(Clone, Copy, Debug)]
pub struct TagCheck {
    pub tags: u64,
    pub ranks: u64,
    pub count: usize,
    pub tag: CallTag,
    pub rank: usize,
}

/// Which backend a group runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Host,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// Which backend a group should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a driver and the requested device exist, else host.
    Auto,
    Cuda,
    Host,
}

impl BackendChoice {
    /// Parses `SYMM_BACKEND`'s value.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(BackendChoice::Auto),
            "cuda" => Ok(BackendChoice::Cuda),
            "host" | "cpu" => Ok(BackendChoice::Host),
            other => Err(err!(InvalidArgument, "SYMM_BACKEND={other:?}: expected auto, cuda or host")),
        }
    }
}

/// The backend for `device` that `choice` asks for, for a group whose
/// failures `health` records: its waits end early once the group failed.
pub fn select(choice: BackendChoice, device: i32, health: &Arc<Health>) -> Result<Arc<dyn Backend>> {
    let host = || Ok(Arc::new(host::HostBackend::new(health.clone())) as Arc<dyn Backend>);
    match choice {
        BackendChoice::Host => host(),
        BackendChoice::Auto if cuda::available(device) => Ok(Arc::new(cuda::CudaBackend::new(device, health)?)),
        BackendChoice::Auto => host(),
        BackendChoice::Cuda => Ok(Arc::new(cuda::CudaBackend::new(device, health)?)),
    }
}

/// A caller's stream (`CUstream` on CUDA, ignored on the host, where every
/// operation completes before it returns). Zero is the default stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stream(pub usize);

/// A mapped range of memory in this rank's address space.
#[allow(clippy::len_without_is_empty)] // mappings are never empty
pub trait Mapping: Send + Sync {
    /// Base address of the mapping.
    fn addr(&self) -> u64;
    /// Length in bytes (granularity-rounded, never 0).
    fn len(&self) -> usize;
}

/// Memory this rank allocated and can export to its peers.
pub trait Allocation: Mapping {
    /// A new fd naming the allocation, to pass to a peer over SCM_RIGHTS.
    fn export_fd(&self) -> Result<OwnedFd>;
}

/// Signalling over the pads of one rendezvoused handle.
///
/// Slots are `u32` at `pad[channel][src_rank]`. A put waits for the slot in
/// the peer's pad to be 0 and sets it to the call's tag (release, system
/// scope); a wait waits for its own slot to hold its tag and sets it back
/// to 0 (acquire), so pads are reusable and replayable. A wait that finds
/// another tag there fails with `Mismatch` (the peer is in another call)
/// and leaves it; waits give up after `timeout` and report the peer they
/// waited for.
pub trait Signals: Send + Sync {
    fn put(&self, peer: usize, channel: usize, tag: CallTag, stream: Stream, timeout: Duration) -> Result<()>;
    fn wait(&self, peer: usize, channel: usize, tag: CallTag, stream: Stream, timeout: Duration) -> Result<()>;
    /// Put to and wait for every other rank on `channel`.
    fn barrier(&self, channel: usize, tag: CallTag, stream: Stream, timeout: Duration) -> Result<()>;
    /// Stream-ordered store of `value` to the `u32` at `addr` (any rank's
    /// buffer as mapped here), after the stream's earlier work.
    fn write_value(&self, addr: u64, value: u32, stream: Stream) -> Result<()>;
    /// Stream-ordered wait until the `u32` at `addr` is >= `value`;
    /// `owner` is the rank whose buffer holds it (for the error message).
    fn wait_value(&self, addr: u64, value: u32, owner: usize, stream: Stream, timeout: Duration) -> Result<()>;
}

/// Where the signal pad of each rank's allocation lives (in this rank's
/// address space), and who we are.
#[derive(Clone, Debug)]
pub struct PadSet {
    pub rank: usize,
    pub world: usize,
    /// `pads[r]` = address of rank r's pad as mapped here; 0 for a rank
    /// whose memory is not mapped here (on another host): it takes no part
    /// in barriers, and signals to or from it are refused.
    pub pads: Vec<u64>,
}

impl PadSet {
    /// Whether `peer`'s pad is mapped here.
    pub fn reaches(&self, peer: usize) -> bool {
        self.pads.get(peer).is_some_and(|&a| a != 0)
    }
}

/// Number of signal channels in every pad.
pub const SIGNAL_CHANNELS: usize = 16;
/// Largest group symm supports (bounds the pad size).
pub const MAX_WORLD: usize = 256;

/// Bytes of signal pad an allocation carries for a group of `world` ranks.
pub fn pad_bytes(world: usize) -> usize {
    SIGNAL_CHANNELS * world * std::mem::size_of::<u32>()
}

/// Byte offset of slot `pad[channel][src]` within a pad.
pub fn slot_offset(world: usize, channel: usize, src: usize) -> usize {
    (channel * world + src) * std::mem::size_of::<u32>()
}

/// How [`Backend::scaled_gemm`] scales its product. Every array is a
/// contiguous, 16-byte aligned vector in the backend's memory (cuBLASLt
/// declines others), read when the matmul runs (so earlier stream work may
/// fill it).
#[derive(Clone, Debug)]
pub struct GemmScales {
    /// Row-wise: `a` has one scale per row of A (m) and `b` one per column
    /// of B (n). Tensor-wise: each holds one scale.
    pub row_wise: bool,
    pub a: Array,
    pub b: Array,
    /// `[n]` of `dst`'s dtype (never f32), added after scaling.
    pub bias: Option<Array>,
}

impl GemmScales {
    /// That these scales fit an `m x n` product into `dst` (see
    /// [`GemmScales`]); every backend holds its callers to it.
    pub fn check(&self, m: usize, n: usize, dst: DType) -> Result<()> {
        let (want_a, want_b) = if self.row_wise { (m, n) } else { (1, 1) };
        let f32_of = |v: &Array, len| v.dtype == DType::F32 && v.numel() == len;
        let bias_ok = self.bias.as_ref().is_none_or(|v| v.numel() == n && v.dtype == dst);
        let vectors = [&self.a, &self.b].into_iter().chain(&self.bias);
        let aligned = vectors.into_iter().all(|v| v.is_contiguous() && v.addr % 16 == 0);
        if f32_of(&self.a, want_a) && f32_of(&self.b, want_b) && bias_ok && aligned {
            Ok(())
        } else {
            Err(err!(Internal, "scaled matmul into {m}x{n} {dst} with scales {self:?}"))
        }
    }

    /// The scales and bias of columns `start..start + len` of the product.
    pub fn columns(&self, start: usize, len: usize) -> GemmScales {
        GemmScales {
            row_wise: self.row_wise,
            a: self.a.clone(),
            b: if self.row_wise { self.b.narrow(0, start, len) } else { self.b.clone() },
            bias: self.bias.as_ref().map(|v| v.narrow(0, start, len)),
        }
    }
}

/// What a backend's fused kernels can do: the data the operations choose
/// an algorithm and lay out a fused call's workspace by, so that kernel
/// constants stay in the backend.
#[derive(Clone, Copy, Debug)]
pub struct Capabilities {
    /// Whether [`Backend::fused_matmul`] runs on this device at all.
    pub fused_matmul: bool,
    /// Most ranks (row chunks) one fused call takes.
    pub max_fused_world: usize,
    /// What the fused all-gather's slice width must be a multiple of.
    pub gather_slice_align: usize,
    /// Whether the fused matmul + reduce-scatter is measured faster than
    /// the other paths on chunks of `chunk_rows x n` over `world` ranks
    /// with `in_elem`-byte inputs, where the cost model finds the call
    /// `comm_heavy` or not. From the shape alone, so that every rank of an
    /// agreed call chooses alike.
    pub fused_scatter_preferred:
        fn(chunk_rows: usize, n: usize, world: usize, in_elem: usize, comm_heavy: bool) -> bool,
    /// Whether [`Backend::all_reduce`] runs here (the device-side one- and
    /// two-shot kernels); without, the operations all-reduce over `copy`,
    /// `reduce` and barriers.
    pub all_reduce: bool,
    /// Whether [`Backend::reduce_integers`] runs here, for integer
    /// all-reduces that do not take the device-side kernels.
    pub reduce_integers: bool,
    /// Whether [`Backend::all_gather`] and [`Backend::reduce_scatter`] run
    /// here (the device-side all-gather and reduce-scatter through the
    /// all-reduce's buffer).
    pub all_gather: bool,
}

impl Default for Capabilities {
    /// No fused kernel.
    fn default() -> Capabilities {
        Capabilities {
            fused_matmul: false,
            max_fused_world: 0,
            gather_slice_align: FusedGather::SLICE_ALIGN,
            fused_scatter_preferred: |_, _, _, _, _| false,
            all_reduce: false,
            reduce_integers: true,
            all_gather: false,
        }
    }
}

/// One device (or the host) that groups allocate on.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// The CUDA device ordinal, or -1 on the host.
    fn device(&self) -> i32;
    /// Allocation sizes are rounded up to a multiple of this.
    fn granularity(&self) -> usize;
    /// Allocates `bytes` (a multiple of `granularity`) of zeroed, exportable memory.
    fn allocate(&self, bytes: usize) -> Result<Box<dyn Allocation>>;
    /// Maps a peer's allocation of `bytes` from the fd it exported.
    fn import(&self, fd: OwnedFd, bytes: usize) -> Result<Box<dyn Mapping>>;
    /// Builds the signalling state for one rendezvoused handle.
    fn signals(&self, pads: PadSet) -> Result<Box<dyn Signals>>;
    /// Reports a failure recorded asynchronously (e.g. by a kernel whose
    /// signal wait timed out); the host backend reports errors synchronously.
    fn check_async_error(&self) -> Result<()> {
        Ok(())
    }

    // The data-moving primitives the operations (`crate::ops`) are written
    // over. Arguments are checked by the operations; a backend may still
    // refuse a combination it does not implement (Unsupported).

    /// Copies `src` into `dst` (same shape, in layouts [`check_copy`]
    /// accepts), converting the element type through f32 when the two
    /// differ (where the backend converts).
    fn copy(&self, dst: &Array, src: &Array, stream: Stream) -> Result<()> {
        let _ = (dst, src, stream);
        Err(err!(Unsupported, "the {} backend does not implement copy", self.kind().name()))
    }

    /// `dst = scale * (srcs[0] + srcs[1] + ...)`, summed in f32; every
    /// source has `dst`'s shape.
    fn reduce(&self, dst: &Array, srcs: &[Array], scale: f32, stream: Stream) -> Result<()> {
        let _ = (dst, srcs, scale, stream);
        Err(err!(Unsupported, "the {} backend does not implement reduce", self.kind().name()))
    }

    /// `dst = (srcs[0] + srcs[1] + ...) / divisor` for integer arrays (no
    /// float round trip): summed in the element type, wrapping modulo
    /// 2^bits, then divided truncating toward zero (`divisor` 1: the sum).
    /// Every source has `dst`'s shape and dtype.
    fn reduce_integers(&self, dst: &Array, srcs: &[Array], divisor: usize, stream: Stream) -> Result<()> {
        let _ = (srcs, divisor, stream);
        Err(err!(Unsupported, "the {} backend does not reduce {} values", self.kind().name(), dst.dtype))
    }

    /// Matrices: `dst = a @ b`, or `dst += a @ b` with `accumulate` (which
    /// needs an f32 `dst`); products are summed in f32 whatever the types.
    /// Or a batch of them (a strided-batched matmul): `[batch, m, k] @
    /// [batch, k, n]` into `[batch, m, n]`, one batch size, matrix i of
    /// each at i times its batch stride; a batch stride of 0 on `a` or `b`
    /// shares one matrix (one B for every batch). The batches of `dst` do
    /// not overlap; what lies between them is not touched.
    fn gemm(&self, dst: &Array, a: &Array, b: &Array, accumulate: bool, stream: Stream) -> Result<()> {
        let _ = (dst, a, b, accumulate, stream);
        Err(err!(Unsupported, "the {} backend does not implement gemm", self.kind().name()))
    }

    /// Matrices of 8-bit floats (A row-major, B column-major, i.e. both
    /// K-major): `dst[i, j] = sa * sb * sum_k a[i, k] * b[k, j] (+ bias[j])`
    /// with the scales of `scales`, products summed in f32, as
    /// `torch._scaled_mm`. `dst` is f32, bf16 or f16; with `accumulate`
    /// its old values are added too (before the one rounding into it).
    fn scaled_gemm(
        &self,
        dst: &Array,
        a: &Array,
        b: &Array,
        scales: &GemmScales,
        accumulate: bool,
        stream: Stream,
    ) -> Result<()> {
        let _ = (dst, a, b, scales, accumulate, stream);
        Err(err!(Unsupported, "the {} backend does not implement fp8 matmuls", self.kind().name()))
    }

    /// Whether this backend and device can run [`Backend::scaled_gemm`]
    /// (with row-wise scales when `row_wise`); asked while a call is
    /// planned, so an fp8 call it cannot run fails before any data moves.
    fn check_scaled_gemm(&self, row_wise: bool) -> Result<()> {
        let _ = row_wise;
        Err(err!(Unsupported, "the {} backend does not implement fp8 matmuls", self.kind().name()))
    }

    /// Stream `i` of the backend's own side streams, which run concurrently
    /// with the caller's (copy-engine pulls overlapping matmuls). The host
    /// backend completes work as it is issued, so any stream will do.
    fn side_stream(&self, i: usize) -> Result<Stream> {
        let _ = i;
        Ok(Stream(0))
    }

    /// Makes `waiter` wait for the work queued on `on` so far (fork and
    /// join of side streams; legal during graph capture).
    fn stream_wait(&self, waiter: Stream, on: Stream) -> Result<()> {
        let _ = (waiter, on);
        Ok(())
    }

    /// Issues one operation's work on `stream` through `issue`, or replays
    /// an earlier issue of the same call: `key` describes the call exactly
    /// (addresses included), and the CUDA backend launches a repeated call
    /// as one captured graph. The host backend just issues. `Ok(true)`:
    /// the work went into a graph the caller is capturing, which goes on
    /// using the memory the call used for as long as it is replayed.
    fn run_repeatable(
        &self,
        key: &dyn Fn() -> ReplayKey,
        stream: Stream,
        issue: &mut dyn FnMut(Stream) -> Result<()>,
    ) -> Result<bool> {
        let _ = key;
        issue(stream).map(|()| false)
    }

    /// Whether `stream` is being captured into a graph (never on the host).
    fn is_capturing(&self, stream: Stream) -> Result<bool> {
        let _ = stream;
        Ok(false)
    }

    /// The call tags of an NCCL step across hosts (`group::NcclTransport`):
    /// stores `tag` into the `u32` at `addr` (device memory) on `stream`,
    /// after the stream's earlier work.
    fn write_tag(&self, addr: u64, tag: CallTag, stream: Stream) -> Result<()> {
        let _ = (addr, tag, stream);
        Err(err!(Unsupported, "call tags in device memory need the CUDA backend"))
    }

    /// On `stream`: unless every member's tag is this rank's, records a
    /// mismatch naming that member's rank in the group's asynchronous
    /// error (see [`TagCheck`]).
    fn check_tags(&self, check: &TagCheck, stream: Stream) -> Result<()> {
        let _ = (check, stream);
        Err(err!(Unsupported, "call tags in device memory need the CUDA backend"))
    }

    /// Waits until the work issued so far that may use memory about to be
    /// freed has finished (the driver unmaps and frees at once, not in
    /// stream order): with `stream`, that stream's and this backend's side
    /// streams' work, and an error (Unsupported) while `stream` is being
    /// captured, since the graph would go on using the memory; without, the
    /// whole device's. Backends that finish their work before returning
    /// need nothing here.
    fn quiesce(&self, stream: Option<Stream>) -> Result<()> {
        let _ = stream;
        Ok(())
    }

    /// Zeroes `bytes` at `addr` (this backend's memory) in stream order.
    fn zero(&self, addr: u64, bytes: usize, stream: Stream) -> Result<()> {
        let _ = (addr, bytes, stream);
        Err(err!(Unsupported, "the {} backend does not implement zero", self.kind().name()))
    }

    /// What this backend's fused kernels can do, for the operations'
    /// choice of algorithm (the same on every rank of a group whose ranks
    /// run the same backend on the same kind of device).
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// `Ok` when [`Backend::fused_matmul`] can run `call` (its operands'
    /// layouts and types), else why not.
    fn fused_matmul_supports(&self, call: &FusedMatmul) -> Result<()> {
        let _ = call;
        Err(err!(Unsupported, "the {} backend has no fused matmul", self.kind().name()))
    }

    /// Enqueues one fused matmul (see [`FusedMatmul`]).
    fn fused_matmul(&self, call: &FusedMatmul, stream: Stream) -> Result<()> {
        let _ = (call, stream);
        Err(err!(Unsupported, "the {} backend has no fused matmul", self.kind().name()))
    }

    /// Enqueues one device-side all-reduce (see [`AllReduceCall`]), where
    /// [`Capabilities::all_reduce`] says so.
    fn all_reduce(&self, call: &AllReduceCall, stream: Stream) -> Result<()> {
        let _ = (call, stream);
        Err(err!(Unsupported, "the {} backend has no all-reduce kernel", self.kind().name()))
    }

    /// Enqueues one device-side all-gather (see [`AllGatherCall`]), where
    /// [`Capabilities::all_gather`] says so.
    fn all_gather(&self, call: &AllGatherCall, stream: Stream) -> Result<()> {
        let _ = (call, stream);
        Err(err!(Unsupported, "the {} backend has no all-gather kernel", self.kind().name()))
    }

    /// Enqueues one device-side reduce-scatter (see [`ReduceScatterCall`]),
    /// where [`Capabilities::all_gather`] says so.
    fn reduce_scatter(&self, call: &ReduceScatterCall, stream: Stream) -> Result<()> {
        let _ = (call, stream);
        Err(err!(Unsupported, "the {} backend has no reduce-scatter kernel", self.kind().name()))
    }

    /// Enqueues `norm` (see [`AddRmsNorm`]).
    fn add_rms_norm(&self, norm: &AddRmsNorm, stream: Stream) -> Result<()> {
        let _ = (norm, stream);
        Err(err!(Unsupported, "the {} backend does not implement rmsnorm", self.kind().name()))
    }

    /// Enqueues `q` (see [`Quantize`]).
    fn quantize(&self, q: &Quantize, stream: Stream) -> Result<()> {
        let _ = (q, stream);
        Err(err!(Unsupported, "the {} backend does not write fp8 outputs", self.kind().name()))
    }
}

/// An fp8 output from an f32 product, as cuBLASLt writes an fp8 D:
/// `dst[i, j] = fp8((src[i, j] + bias_weight * bias[j]) * scale)`, the
/// arithmetic in f32 in that order, rounded once (`Fp8::encode`: to
/// nearest even, saturating, NaN kept). `dst` is an fp8 matrix `[m, n]` of
/// any strides, `src` a contiguous f32 `[m, n]` that does not overlap it;
/// `bias` a contiguous bf16 or f16 `[n]`; `scale` one f32 element, read
/// when the work runs (so earlier stream work may fill it), absent: 1.
#[derive(Clone, Copy, Debug)]
pub struct Quantize<'a> {
    pub dst: &'a Array,
    pub src: &'a Array,
    pub bias: Option<&'a Array>,
    pub bias_weight: f32,
    pub scale: Option<&'a Array>,
}

/// `residual_out = x + residual; out = residual_out / sqrt(mean(residual_out^2
/// over the last dimension) + eps) * weight`, computed in f32 (the sum
/// rounded to `residual_out`'s dtype before the norm reads it back).
/// Matrices `[rows, hidden]` of one dtype (any row stride, unit column
/// stride), `weight` a contiguous `[hidden]`; `residual_out` may be
/// `residual` or `x`.
#[derive(Clone, Copy)]
pub struct AddRmsNorm<'a> {
    pub out: &'a Array,
    pub residual_out: &'a Array,
    pub x: &'a Array,
    pub residual: &'a Array,
    pub weight: &'a Array,
    pub eps: f32,
}

/// How a device-side all-reduce moves its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllReduceAlgorithm {
    /// Every rank pushes its whole input to every peer (flag in the data,
    /// LL), then reduces everything: one trip over the links, the lowest
    /// latency; each rank moves `(world - 1) x` the message.
    OneShot,
    /// Reduce-scatter then all-gather: each rank reduces a `1/world` slice
    /// (peers push it their parts) and pushes the result to every peer,
    /// with a sequence-numbered flag per chunk; `2 (world - 1) / world` of
    /// the message moves, for large messages.
    TwoShot,
}

impl AllReduceAlgorithm {
    pub fn name(self) -> &'static str {
        match self {
            AllReduceAlgorithm::OneShot => "one_shot",
            AllReduceAlgorithm::TwoShot => "two_shot",
        }
    }
}

/// The fused epilogue of [`AllReduceCall`]: with `s` the reduced row,
/// `residual_out = s + residual`, `out = rmsnorm(residual_out) * weight`
/// (see [`Backend::add_rms_norm`]); `out` is then the call's `output`.
/// Contiguous `[n / hidden, hidden]` rows (`weight` `[hidden]`).
#[derive(Clone, Debug, PartialEq)]
pub struct AllReduceNorm {
    pub hidden: usize,
    pub residual: u64,
    pub weight: u64,
    pub residual_out: u64,
    pub eps: f32,
}

/// One device-side all-reduce: `output = scale * sum over ranks of input`
/// (`n` contiguous elements of `dtype`, summed in f32 in rank order, so
/// every rank gets the same bits; integer dtypes: `sum / divisor`, summed
/// exactly in the element type as [`Backend::reduce_integers`]), moved through `scratch`: every rank's
/// all-reduce scratch buffer (its base as mapped here, `scratch_bytes`
/// each, laid out by [`AllReduceLayout`]). The buffer starts zeroed and no
/// other work than these calls and [`AllGatherCall`]s writes it: it counts
/// the calls, whose numbers flag the data,
/// so calls need no barrier before or after them and replay as graphs.
/// `output` may be `input`.
#[derive(Clone, Debug, PartialEq)]
pub struct AllReduceCall {
    pub algorithm: AllReduceAlgorithm,
    pub rank: usize,
    pub world: usize,
    pub dtype: crate::array::DType,
    pub n: usize,
    pub input: u64,
    pub output: u64,
    pub scale: f32,
    /// Integer dtypes: what the wrapped sum is divided by (1: SUM, the
    /// world: AVG); float dtypes use `scale`.
    pub divisor: usize,
    pub scratch: Vec<u64>,
    pub scratch_bytes: usize,
    pub norm: Option<AllReduceNorm>,
    pub timeout: Duration,
    /// The call's tag: each rank announces it to the peers it sends
    /// lines, and checks theirs before it uses their data.
    pub tag: CallTag,
}

/// One device-side all-gather: `output[r * bytes..(r + 1) * bytes]` =
/// rank r's `input` for every rank r, where `input` is `bytes` contiguous
/// bytes and `output` `world * bytes` (it does not overlap `input`). A
/// copy: bytes are bytes, whatever the element type. Moved as the
/// one-shot all-reduce moves its message ([`AllReduceCall`]'s `scratch`,
/// the same buffers, layout and count of calls, so all-gathers and
/// all-reduces follow one another in any order with no barrier): each
/// rank stores its input as LL lines into every peer's one-shot slot
/// (its parity, this rank), then places the lines of its own slots into
/// the output as they arrive (`OneShot`); or (`TwoShot`) as the
/// reduce-scatter by pieces moves its chunks, placed instead of summed:
/// plain stores into every peer's two-shot slot, a flag per piece.
#[derive(Clone, Debug, PartialEq)]
pub struct AllGatherCall {
    pub algorithm: AllReduceAlgorithm,
    pub rank: usize,
    pub world: usize,
    pub bytes: usize,
    pub input: u64,
    pub output: u64,
    pub scratch: Vec<u64>,
    pub scratch_bytes: usize,
    pub timeout: Duration,
    /// As [`AllReduceCall::tag`].
    pub tag: CallTag,
}

/// One device-side reduce-scatter: `output` (`n` contiguous elements of
/// `dtype`, a float type) = `scale` x the sum over ranks, in f32 in rank
/// order, of their chunk for this rank, where each rank's `input` holds
/// `world` chunks of `n` elements, chunk q at `input + q * chunk_stride`
/// bytes (`n * size` and `chunk_stride` multiples of 8, `input` 8-byte
/// aligned: every chunk whole LL lines). Moved as [`AllGatherCall`]s are
/// (the same buffers, layout and count of calls, so it follows them and
/// all-reduces in any order with no barrier), except that each rank
/// stores chunk q into rank q's slot only: as LL lines (`OneShot`), or
/// (`TwoShot`) as the two-shot's first trip, in pieces with a flag each.
#[derive(Clone, Debug, PartialEq)]
pub struct ReduceScatterCall {
    pub algorithm: AllReduceAlgorithm,
    pub rank: usize,
    pub world: usize,
    pub dtype: DType,
    pub n: usize,
    pub input: u64,
    pub chunk_stride: usize,
    pub output: u64,
    pub scale: f32,
    pub scratch: Vec<u64>,
    pub scratch_bytes: usize,
    pub timeout: Duration,
    /// As [`AllReduceCall::tag`].
    pub tag: CallTag,
}

impl ReduceScatterCall {
    /// `Internal` unless the call keeps to the lines' rules above.
    pub fn check(&self) -> Result<()> {
        let bytes = self.n * self.dtype.size();
        let float = matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16);
        if !float
            || bytes % 8 != 0
            || self.chunk_stride % 8 != 0
            || self.chunk_stride < bytes
            || self.input % 8 != 0
            || self.input == 0
            || self.output == 0
        {
            return Err(err!(
                Internal,
                "a reduce-scatter on the lines of {} x {} {} chunks {} bytes apart from {:#x} into {:#x}",
                self.world,
                self.n,
                self.dtype,
                self.chunk_stride,
                self.input,
                self.output
            ));
        }
        Ok(())
    }
}

/// Where a device-side all-reduce keeps its state and data in a scratch
/// buffer of a given size: a function of that size and the world only
/// (never of the call), so that calls of any size and algorithm read the
/// flags and lines of earlier calls where those wrote them.
///
/// - `[0, HEADER)`: the count of calls (u32 at 0) and the blocks of the
///   running call that finished (u32 at 4).
/// - `[HEADER, HEADER + 8 * MAX_NORM_BLOCKS)`: the fused RMSNorm's sums of
///   squares, one call-numbered word per block, where a row is split over
///   several blocks (read only by this rank's blocks).
/// - [`AllReduceLayout::tag_at`]: per (parity, source), a `u64` the source
///   stores before its lines, `{call number, call tag}`, which a rank
///   checks against its own before it uses that source's data.
/// - flags: `u32` per (parity, source, chunk) for the two-shot, `source`
///   0..world the reduce-scatter's senders and `world` the all-gather's;
///   [`AllReduceLayout::MAX_CHUNKS`] chunks per source.
/// - the one-shot's LL lines: per parity, one slot per rank.
/// - the two-shot's data: per parity, one slot per rank (first half: the
///   part that rank sent for this rank's slice; second half: that rank's
///   reduced slice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllReduceLayout {
    pub world: usize,
    pub flags: usize,
    pub one_shot: usize,
    /// Bytes of one rank's one-shot slot (LL lines: twice the message).
    pub one_shot_slot: usize,
    pub two_shot: usize,
    /// Bytes of one rank's two-shot slot (twice the largest slice).
    pub two_shot_slot: usize,
}

impl AllReduceLayout {
    pub const HEADER: usize = 256;
    /// Most blocks a fused RMSNorm launch splitting rows takes (its partial
    /// sums after the header).
    pub const MAX_NORM_BLOCKS: usize = 448;
    /// Most ranks the device-side kernels take (their table of buffers).
    pub const MAX_WORLD: usize = 16;
    /// Flags per source: more than the chunks of any call
    /// (`world * GROUPS` and a remainder, `world` at most `MAX_WORLD`).
    pub const MAX_CHUNKS: usize = 4096;
    /// Chunk groups (one chunk per owner) a two-shot call is cut into when
    /// large: one per block of its launch, about one per SM, so that each
    /// block pays one barrier and one flag per phase.
    pub const GROUPS: usize = 128;
    /// Smallest two-shot chunk, bytes (one 16-byte access per thread of a block).
    pub const MIN_CHUNK: usize = 8 << 10;
    const ALIGN: usize = 4096;

    /// Where the sources' call tags begin: after the norm's partial sums.
    pub const TAGS: usize = Self::HEADER + 8 * Self::MAX_NORM_BLOCKS;

    /// Where the flags begin: after the header, the norm's partial sums
    /// and the call tags.
    fn flags_start() -> usize {
        (Self::TAGS + 16 * Self::MAX_WORLD).next_multiple_of(Self::ALIGN)
    }

    /// Offset of the `{call number, call tag}` word that rank `src` stores
    /// for calls of `parity` (0 or 1) (`tags_off + (parity * SYMM_AR_MAX_WORLD
    /// + src) * 8` of kernels/allreduce.cu).
    pub fn tag_at(parity: usize, src: usize) -> usize {
        Self::TAGS + (parity * Self::MAX_WORLD + src) * 8
    }

    fn flags_bytes(world: usize) -> usize {
        round_up(2 * (world + 1) * Self::MAX_CHUNKS * 4, Self::ALIGN)
    }

    /// The layout of a buffer of `bytes` for `world` ranks.
    pub fn of(bytes: usize, world: usize) -> AllReduceLayout {
        let flags = Self::flags_start();
        let data = flags + Self::flags_bytes(world);
        let half = bytes.saturating_sub(data) / 2 / Self::ALIGN * Self::ALIGN;
        let slot = |region: usize| region / (2 * world) / 256 * 256;
        AllReduceLayout {
            world,
            flags,
            one_shot: data,
            one_shot_slot: slot(half),
            two_shot: data + half,
            two_shot_slot: slot(half),
        }
    }

    /// Bytes of one rank's slot that a message of `bytes` per rank needs:
    /// its LL lines (twice the message), or the two-shot's chunks of one
    /// owner, sent and reduced.
    fn slot_for(message: usize, world: usize) -> usize {
        let chunk = Self::chunk_bytes(message, world);
        let owned = message.div_ceil(chunk).div_ceil(world.max(1)) * chunk;
        round_up((2 * round_up(message, 16)).max(2 * owned), 256)
    }

    /// Bytes of a buffer whose layout holds a message of `bytes` per rank
    /// for either algorithm.
    pub fn bytes_for(message: usize, world: usize) -> usize {
        let half = 2 * world * Self::slot_for(message, world);
        Self::flags_start() + Self::flags_bytes(world) + 2 * round_up(half, Self::ALIGN)
    }

    /// Offset of the one-shot slot of `parity` (0 or 1) for the lines
    /// rank `src` sends (`one_off + (parity * world + src) * one_slot` of
    /// kernels/allreduce.cu).
    pub fn one_shot_at(&self, parity: usize, src: usize) -> usize {
        self.one_shot + (parity * self.world + src) * self.one_shot_slot
    }

    /// Whether this layout holds a message of `bytes` per rank.
    pub fn holds(&self, message: usize) -> bool {
        let slot = Self::slot_for(message, self.world);
        slot <= self.one_shot_slot && slot <= self.two_shot_slot
    }

    /// The two-shot's chunk size for a message of `message` bytes over
    /// `world` ranks: `world` chunks per group, at most [`Self::GROUPS`]
    /// groups, at least [`Self::MIN_CHUNK`], a multiple of 16 bytes.
    pub fn chunk_bytes(message: usize, world: usize) -> usize {
        round_up(message.div_ceil(world.max(1) * Self::GROUPS).max(Self::MIN_CHUNK), 16)
    }

    /// The two-shot's chunk groups for a message of `message` bytes cut into
    /// chunks of `chunk`: chunk `c` is in group `c / world` and owned by rank
    /// `c % world`.
    pub fn groups_of(message: usize, chunk: usize, world: usize) -> usize {
        message.div_ceil(chunk.max(1)).div_ceil(world.max(1))
    }
}

/// One launch of a fused matmul: `c = alpha * a @ b` (matrices; `b` is
/// `[k, n]`), `a`'s rows in equal chunks of `chunk_rows` (one per rank)
/// visited in `order`, with an all-gather feeding it or a reduce-scatter
/// taking its result; with fp8 `a` and `b`, `c = alpha * (sa * sb * a @ b
/// + bias)` as [`GemmScales`] say. Addresses are this rank's mappings.
#[derive(Clone, Debug)]
pub struct FusedMatmul {
    pub a: Array,
    pub b: Array,
    pub c: Array,
    pub chunk_rows: usize,
    pub order: Vec<usize>,
    pub gather: Option<FusedGather>,
    pub scatter: Option<FusedScatter>,
    pub alpha: f32,
    /// fp8: the scales (row-wise: `a` holds the row scales of every chunk,
    /// chunk c's from element `c * chunk_rows`, or `c * scale_slot` when
    /// gathered) and bias.
    pub scales: Option<GemmScales>,
    /// Multiprocessors to leave free for kernels that must run beside this
    /// one (the signal kernels of a concurrent barrier).
    pub spare_sms: u32,
    pub timeout: Duration,
}

/// Rows of `a` arrive chunk by chunk, each in slices of `slice_k` columns,
/// slice s of chunk c announced by a nonzero u32 at
/// `ready + 4 * (c * slices + s)`, `slices = k / slice_k`; chunk
/// `local_chunk` is read from `local` instead. One slice when `slice_k`
/// is k: `a` is then an ordinary matrix. With several slices (`slice_k` a
/// multiple of [`FusedGather::SLICE_ALIGN`] dividing k), `a` must be a
/// contiguous `[m, k]` array whose memory holds the rows slice-major,
/// `[slices][m][slice_k]`, so that each slice of a chunk is one contiguous
/// copy. Row-wise fp8 scales arrive with their rows (before the first
/// slice's flag), chunk c's at element `c * scale_slot` of the scales' `a`.
#[derive(Clone, Debug)]
pub struct FusedGather {
    pub ready: u64,
    pub slice_k: usize,
    pub local_chunk: usize,
    pub local: Array,
    pub scale_slot: usize,
}

/// Chunk `d` of the product is rank `d`'s: pushed into `inbox[d]` (slot
/// `rank`) and announced in the tile flags of `state[d]`; this rank's own
/// chunk, visited last, is summed with the peers' partials into `c`. Sizes:
/// an inbox holds a `chunk_rows x n` slot of C's type per rank; a state,
/// [`FusedMatmul::state_bytes`]. The state starts zeroed and no other work
/// may write it or the inbox: it counts the calls, which is what lets one
/// call follow another with no barrier between them.
///
/// `out`: every rank's `c` as mapped here, where each lies at the same
/// offset of one symmetric buffer, contiguous: the peer may then store its
/// partials straight into it instead of the inbox, and the own tiles add
/// theirs (world 2; each rank's product is then rounded to C's type before
/// the sum, its own included).
///
/// `tag` goes with the pushed partials: a rank whose peer pushes another
/// call's records a `Mismatch` (that call's output undefined).
#[derive(Clone, Debug)]
pub struct FusedScatter {
    pub rank: usize,
    pub inbox: Vec<u64>,
    pub state: Vec<u64>,
    pub out: Option<Vec<u64>>,
    pub tag: CallTag,
}

impl FusedGather {
    /// What a slice's width must be a multiple of: whole k-blocks of the
    /// fused kernel for every input type.
    pub const SLICE_ALIGN: usize = 128;
}

impl FusedMatmul {
    /// The reduce-scatter state's header (`SYMM_RS_STATE_BYTES`: the count
    /// of calls), before its tile flags.
    pub const STATE_HEADER_BYTES: usize = 256;

    /// Bytes of one rank's reduce-scatter state: the header, then its tile
    /// flags (at most; any tile width fits).
    pub fn state_bytes(chunk_rows: usize, n: usize, world: usize) -> usize {
        // 128 x 128 is the smallest tile the kernels use.
        Self::STATE_HEADER_BYTES + chunk_rows.div_ceil(128) * n.div_ceil(128) * world * 4
    }
}

/// The layouts every backend copies between: one side contiguous, or
/// both matrices of rows apart (pitched, unit column stride). The CUDA
/// backend can do no other (copy engines, pack and unpack kernels), so the
/// host backend refuses the rest too: what runs there runs on CUDA.
pub fn check_copy(dst: &Array, src: &Array) -> Result<()> {
    let pitched = |a: &Array| a.as_matrix().is_some_and(|m| m.strides[1] == 1);
    if dst.is_contiguous() || src.is_contiguous() || (pitched(dst) && pitched(src)) {
        return Ok(());
    }
    Err(err!(
        Internal,
        "a copy between strides {:?} and {:?} of shape {:?}: one side must be contiguous, or both pitched matrices",
        src.strides,
        dst.strides,
        src.shape
    ))
}

/// Rounds `n` up to a multiple of `to` (a power of two or not).
pub fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}
