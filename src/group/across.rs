//! The group's transports between ranks that cannot map each other's
//! memory: collectives over a set of *members* for the levels of
//! `crate::ops::hierarchy`'s plans. Across hosts the members are the
//! ranks that share this rank's local index, one per host, in host order;
//! inside a host, the ranks of this rank's host, in local order (for the
//! steps that do not take symmetric memory, `crate::ops::inside_host`).
//! Every member calls each
//! collective at the same point; buffers are contiguous, in the backend's
//! memory.
//!
//! Two implementations: NCCL (the CUDA backend; one communicator per set
//! of members, made when the group forms) and the group's bootstrap (the
//! host backend: bytes through the bootstrap's all-gather; slow but
//! correct, for tests of groups on declared hosts).

use super::{Group, Purpose};
use crate::array::{Array, DType};
use crate::backend::cuda::device_bytes::DeviceBytes;
use crate::backend::cuda::nccl::{self, Communicator};
use crate::backend::host::elementwise;
use crate::backend::{CallTag, Stream, TagCheck};
use crate::error::{err, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Collectives over the members (see the module documentation). Sums only:
/// integers wrap, floats are summed in f32 (bootstrap) or as NCCL does.
///
/// Each collective carries the call's tag (`CallTag`), exchanged beside
/// its data: a member in another call (ranks out of step between calls
/// kept after their agreement) fails the group with `Mismatch` naming
/// that rank, instead of leaving the wrong call's data unnoticed. The
/// bootstrap checks before it uses the data; NCCL's check runs on the
/// stream after the collective, into the group's asynchronous error
/// (reported by the next call or synchronization).
pub trait AcrossHosts: Send + Sync {
    /// The members, in order (this rank among them).
    fn members(&self) -> &[usize];

    /// `recv` (members x `send`'s elements) receives every member's `send`,
    /// in the members' order.
    fn all_gather(&self, group: &Group, send: &Array, recv: &Array, stream: Stream, tag: CallTag) -> Result<()>;

    /// `recv` (`send`'s shape) receives the sum of every member's `send`.
    fn all_reduce(&self, group: &Group, send: &Array, recv: &Array, stream: Stream, tag: CallTag) -> Result<()>;

    /// `send` holds one block of `recv`'s elements per member, in the
    /// members' order; `recv` receives the sum over members of this rank's block.
    fn reduce_scatter(&self, group: &Group, send: &Array, recv: &Array, stream: Stream, tag: CallTag) -> Result<()>;
}

/// Which collective, for checks and messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Collective {
    AllGather,
    AllReduce,
    ReduceScatter,
}

/// `Internal` unless both buffers are contiguous, of one dtype, and sized
/// for `what` over `members`.
pub(crate) fn check(what: Collective, send: &Array, recv: &Array, members: usize) -> Result<()> {
    let (s, r) = (send.numel(), recv.numel());
    let sized = match what {
        Collective::AllGather => r == s * members,
        Collective::AllReduce => r == s,
        Collective::ReduceScatter => s == r * members,
    };
    if !send.is_contiguous() || !recv.is_contiguous() || send.dtype != recv.dtype || !sized {
        return Err(err!(
            Internal,
            "{what:?} across {members} hosts of {} {} elements into {} {} elements (contiguous: {}, {})",
            s,
            send.dtype,
            r,
            recv.dtype,
            send.is_contiguous(),
            recv.is_contiguous()
        ));
    }
    Ok(())
}

/// The bootstrap's transport: every rank of the group offers its bytes to
/// one exchange, and each keeps its members'. Every rank of the group must
/// call the same collective at once (the plans' levels are collective over
/// the whole group), with the collective lock held.
pub struct Bootstrapped {
    members: Vec<usize>,
    /// This rank's place among the members (its host's index).
    index: usize,
}

impl Bootstrapped {
    pub fn new(members: Vec<usize>, rank: usize) -> Result<Bootstrapped> {
        let index = members
            .iter()
            .position(|&m| m == rank)
            .ok_or_else(|| err!(Internal, "rank {rank} is not among its members across hosts {members:?}"))?;
        Ok(Bootstrapped { members, index })
    }

    /// Every member's `send`, each in 8-byte aligned memory (reductions
    /// load elements in place), after the call tag that precedes it
    /// matched this rank's on every member (else the group fails).
    fn gather(&self, group: &Group, send: &Array, tag: CallTag) -> Result<Vec<Vec<u64>>> {
        let bytes = send.numel() * send.dtype.size();
        let mut mine = tag.get().to_le_bytes().to_vec();
        // SAFETY: `send` is contiguous (checked) and readable for its extent.
        mine.extend_from_slice(unsafe { std::slice::from_raw_parts(send.addr as *const u8, bytes) });
        let all = group.exchange(Purpose::Data, Ok(mine))?;
        for &m in &self.members {
            let theirs = all[m].get(..4).map(|t| u32::from_le_bytes(t.try_into().expect("4 bytes")));
            if theirs != Some(tag.get()) {
                let e = CallTag::mismatch("an exchange across hosts: ", m, theirs.map(|t| (CallTag::from_raw(t), tag)));
                group.fail(&e);
                return Err(e);
            }
        }
        self.members
            .iter()
            .map(|&m| {
                let got = &all[m][4..];
                if got.len() != bytes {
                    return Err(err!(Internal, "rank {m} sent {} bytes across hosts, not {bytes}", got.len()));
                }
                let mut words = vec![0u64; bytes.div_ceil(8)];
                // SAFETY: `words` holds at least `bytes` bytes; no overlap.
                unsafe { std::ptr::copy_nonoverlapping(got.as_ptr(), words.as_mut_ptr().cast::<u8>(), bytes) };
                Ok(words)
            })
            .collect()
    }
}

/// `dst = sum of srcs` in `dst`'s dtype.
fn sum_into(dst: &Array, srcs: &[Array]) -> Result<()> {
    if dst.dtype.is_integer() {
        elementwise::reduce_integers(dst, srcs, 1)
    } else {
        elementwise::reduce(dst, srcs, 1.0)
    }
}

/// `count` elements of `dtype` at element `offset` of `words`.
fn view(words: &[u64], dtype: DType, offset: usize, count: usize) -> Array {
    Array::contiguous(words.as_ptr() as u64 + (offset * dtype.size()) as u64, dtype, &[count])
}

impl AcrossHosts for Bootstrapped {
    fn members(&self) -> &[usize] {
        &self.members
    }

    fn all_gather(&self, group: &Group, send: &Array, recv: &Array, _: Stream, tag: CallTag) -> Result<()> {
        check(Collective::AllGather, send, recv, self.members.len())?;
        let n = send.numel();
        let all = self.gather(group, send, tag)?;
        for (h, words) in all.iter().enumerate() {
            let dst = Array::contiguous(recv.addr + (h * n * recv.dtype.size()) as u64, recv.dtype, &[n]);
            elementwise::copy(&dst, &view(words, send.dtype, 0, n))?;
        }
        Ok(())
    }

    fn all_reduce(&self, group: &Group, send: &Array, recv: &Array, _: Stream, tag: CallTag) -> Result<()> {
        check(Collective::AllReduce, send, recv, self.members.len())?;
        let n = send.numel();
        let all = self.gather(group, send, tag)?;
        let srcs: Vec<Array> = all.iter().map(|w| view(w, send.dtype, 0, n)).collect();
        sum_into(&Array::contiguous(recv.addr, recv.dtype, &[n]), &srcs)
    }

    fn reduce_scatter(&self, group: &Group, send: &Array, recv: &Array, _: Stream, tag: CallTag) -> Result<()> {
        check(Collective::ReduceScatter, send, recv, self.members.len())?;
        let n = recv.numel();
        let all = self.gather(group, send, tag)?;
        let srcs: Vec<Array> = all.iter().map(|w| view(w, send.dtype, self.index * n, n)).collect();
        sum_into(&Array::contiguous(recv.addr, recv.dtype, &[n]), &srcs)
    }
}

/// NCCL's transport (the CUDA backend): a communicator over the members,
/// whose collectives are enqueued on the caller's stream. Each step's
/// call tag is stored into a slot of device memory by a stream write,
/// all-gathered in the same NCCL group as the step's data, and checked by
/// a one-thread kernel after it (`Backend::check_tags`).
pub struct NcclTransport {
    comm: Arc<Communicator>,
    members: Vec<usize>,
    /// Device memory: the members' group ranks (`i32`s), then
    /// [`TAG_SLOTS`] slots of `1 + members` `u32` tags (this rank's, then
    /// every member's).
    tags: DeviceBytes,
    /// The next step's slot (mod [`TAG_SLOTS`]).
    next: AtomicUsize,
}

/// Slots of call tags, used in turn: steps queued on different streams
/// would race on one; `TAG_SLOTS` steps apart they take the same slot.
const TAG_SLOTS: usize = 64;

impl NcclTransport {
    /// `comm`'s device must be current (as `Communicator::join` leaves it).
    pub fn new(comm: Communicator, members: Vec<usize>) -> Result<NcclTransport> {
        let ranks: Vec<u8> = members.iter().flat_map(|&m| (m as i32).to_le_bytes()).collect();
        let tags = DeviceBytes::new(ranks.len() + TAG_SLOTS * (1 + members.len()) * 4)?;
        tags.write(0, &ranks)?;
        Ok(NcclTransport { comm: Arc::new(comm), members, tags, next: AtomicUsize::new(0) })
    }

    /// The communicator, for the group's watchdog to abort.
    pub fn communicator(&self) -> Arc<Communicator> {
        self.comm.clone()
    }

    /// `data` (the step's collectives) in one NCCL group with the gather of
    /// every member's `tag`, then their check.
    fn tagged(&self, group: &Group, stream: Stream, tag: CallTag, data: impl FnOnce() -> Result<()>) -> Result<()> {
        let m = self.members.len();
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % TAG_SLOTS;
        let mine = self.tags.addr + (4 * (m + slot * (1 + m))) as u64;
        let backend = group.backend();
        backend.write_tag(mine, tag, stream)?;
        self.comm.grouped(|| {
            data()?;
            self.comm.all_gather(mine, mine + 4, 4, stream.0)
        })?;
        let check = TagCheck { tags: mine + 4, ranks: self.tags.addr, count: m, tag, rank: group.rank() };
        backend.check_tags(&check, stream)
    }
}

/// NCCL's type for summing `dtype`, or `Unsupported`.
fn nccl_type(dtype: DType) -> Result<std::ffi::c_int> {
    nccl::reduce_type(dtype).ok_or_else(|| err!(Unsupported, "sums of {dtype} across hosts are not supported"))
}

impl AcrossHosts for NcclTransport {
    fn members(&self) -> &[usize] {
        &self.members
    }

    fn all_gather(&self, group: &Group, send: &Array, recv: &Array, stream: Stream, tag: CallTag) -> Result<()> {
        check(Collective::AllGather, send, recv, self.members.len())?;
        let bytes = send.numel() * send.dtype.size();
        self.tagged(group, stream, tag, || self.comm.all_gather(send.addr, recv.addr, bytes, stream.0))
    }

    fn all_reduce(&self, group: &Group, send: &Array, recv: &Array, stream: Stream, tag: CallTag) -> Result<()> {
        check(Collective::AllReduce, send, recv, self.members.len())?;
        let t = nccl_type(send.dtype)?;
        self.tagged(group, stream, tag, || self.comm.all_reduce(send.addr, recv.addr, send.numel(), t, stream.0))
    }

    fn reduce_scatter(&self, group: &Group, send: &Array, recv: &Array, stream: Stream, tag: CallTag) -> Result<()> {
        check(Collective::ReduceScatter, send, recv, self.members.len())?;
        let t = nccl_type(send.dtype)?;
        self.tagged(group, stream, tag, || self.comm.reduce_scatter(send.addr, recv.addr, recv.numel(), t, stream.0))
    }
}

/// NCCL's transports (across hosts and inside each) on GPUs of one
/// machine, the ranks declared on pretend hosts (`["a", "b"]` on two GPUs,
/// `["a", "b", "a", "b"]` on four): every collective against a reference from every rank's input, outputs
/// poisoned. Named `gpu_*`; skipped without the GPUs or NCCL.
#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::backend::cuda::driver;
    use crate::backend::cuda::gpu_testing::{gpu_on, report_skipped};
    use crate::backend::BackendChoice;
    use crate::bootstrap::local::local_bootstraps;
    use crate::group::GroupConfig;
    use std::sync::Arc;
    use std::time::Duration;

    fn value(r: usize, i: usize) -> f32 {
        (r * 10 + i) as f32 - 7.5
    }

    fn run(hosts: &[&str]) {
        let groups: Vec<Arc<Group>> = std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(hosts.len())
                .into_iter()
                .zip(hosts)
                .enumerate()
                .map(|(r, (b, h))| {
                    let cfg = GroupConfig {
                        backend: Some(BackendChoice::Cuda),
                        timeout: Some(Duration::from_secs(60)),
                        host_id: Some(h.to_string()),
                        ..Default::default()
                    };
                    s.spawn(move || Group::new(Box::new(b), r as i32, &cfg).expect("a CUDA group on pretend hosts"))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::thread::scope(|s| {
            for g in &groups {
                s.spawn(move || {
                    let gpu = gpu_on(g.device());
                    // Across hosts, then inside each host: the same order on every rank.
                    for t in [g.across_hosts(), g.inside_host()] {
                        let t = t.expect("spans hosts");
                        let m = t.members().to_vec();
                        let (r, n, f, tag) = (g.rank(), 1000, DType::F32, CallTag::of(b"collectives"));
                        let dev = |b: &crate::backend::cuda::gpu_testing::DevBuf, len: usize| {
                            Array::contiguous(b.ptr, f, &[len])
                        };
                        let send: Vec<f32> = (0..n * m.len()).map(|i| value(r, i)).collect();
                        let sbuf = gpu.upload(&send);
                        let rbuf = gpu.upload(&vec![f32::NAN; n * m.len()]);
                        t.all_gather(g, &dev(&sbuf, n), &dev(&rbuf, n * m.len()), gpu.stream(), tag).unwrap();
                        gpu.sync();
                        let want: Vec<f32> = m.iter().flat_map(|&p| (0..n).map(move |i| value(p, i))).collect();
                        assert_eq!(rbuf.read::<f32>(n * m.len()), want, "all-gather on rank {r}");
                        rbuf.write(&vec![f32::NAN; n * m.len()]);
                        t.all_reduce(g, &dev(&sbuf, n), &dev(&rbuf, n), gpu.stream(), tag).unwrap();
                        gpu.sync();
                        let want: Vec<f32> = (0..n).map(|i| m.iter().map(|&p| value(p, i)).sum()).collect();
                        assert_eq!(rbuf.read::<f32>(n), want, "all-reduce on rank {r}");
                        rbuf.write(&vec![f32::NAN; n * m.len()]);
                        t.reduce_scatter(g, &dev(&sbuf, n * m.len()), &dev(&rbuf, n), gpu.stream(), tag).unwrap();
                        gpu.sync();
                        let h = m.iter().position(|&p| p == r).unwrap();
                        let want: Vec<f32> = (0..n).map(|i| m.iter().map(|&p| value(p, h * n + i)).sum()).collect();
                        assert_eq!(rbuf.read::<f32>(n), want, "reduce-scatter on rank {r}");
                    }
                    assert!(g.failure().is_none(), "rank {}: {:?}", g.rank(), g.failure());
                });
            }
        });
        // Then one rank in another call: every rank's group fails with
        // `Mismatch`, naming a rank across hosts.
        std::thread::scope(|s| {
            for g in &groups {
                s.spawn(move || {
                    let gpu = gpu_on(g.device());
                    let t = g.across_hosts().expect("spans hosts");
                    let n = t.members().len();
                    let (sbuf, rbuf) = (gpu.upload(&[1f32; 4]), gpu.upload(&vec![0f32; 4 * n]));
                    let dev = |b: &crate::backend::cuda::gpu_testing::DevBuf, len: usize| {
                        Array::contiguous(b.ptr, DType::F32, &[len])
                    };
                    let tag = CallTag::of(if g.rank() == 0 { b"one call" } else { b"another" });
                    t.all_gather(g, &dev(&sbuf, 4), &dev(&rbuf, 4 * n), gpu.stream(), tag).unwrap();
                    gpu.sync();
                    let e = g.failure().expect("a step with another call's tag fails the group");
                    assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "{}", e.msg);
                    assert!(e.msg.contains("an exchange across hosts: rank "), "{}", e.msg);
                });
            }
        });
    }

    #[test]
    fn gpu_nccl_transport_across_pretend_hosts() {
        if driver::device_count() < 2 || nccl::load().is_err() {
            report_skipped();
            return;
        }
        run(&["a", "b"]);
        if driver::device_count() >= 4 {
            run(&["a", "b", "a", "b"]);
        }
    }
}
