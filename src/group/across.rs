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
use crate::backend::cuda::nccl::{self, Communicator};
use crate::backend::host::elementwise;
use crate::backend::Stream;
use crate::error::{err, Result};
use std::sync::Arc;

/// Collectives over the members (see the module documentation). Sums only:
/// integers wrap, floats are summed in f32 (bootstrap) or as NCCL does.
pub trait AcrossHosts: Send + Sync {
    /// The members, in order (this rank among them).
    fn members(&self) -> &[usize];

    /// `recv` (members x `send`'s elements) receives every member's `send`,
    /// in the members' order.
    fn all_gather(&self, group: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()>;

    /// `recv` (`send`'s shape) receives the sum of every member's `send`.
    fn all_reduce(&self, group: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()>;

    /// `send` holds one block of `recv`'s elements per member, in the
    /// members' order; `recv` receives the sum over members of this rank's block.
    fn reduce_scatter(&self, group: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()>;
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
    /// load elements in place).
    fn gather(&self, group: &Group, send: &Array) -> Result<Vec<Vec<u64>>> {
        let bytes = send.numel() * send.dtype.size();
        // SAFETY: `send` is contiguous (checked) and readable for its extent.
        let mine = unsafe { std::slice::from_raw_parts(send.addr as *const u8, bytes) }.to_vec();
        let all = group.exchange_across_hosts(Purpose::Data, Ok(mine))?;
        self.members
            .iter()
            .map(|&m| {
                let got = &all[m];
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

    fn all_gather(&self, group: &Group, send: &Array, recv: &Array, _: Stream) -> Result<()> {
        check(Collective::AllGather, send, recv, self.members.len())?;
        let n = send.numel();
        let all = self.gather(group, send)?;
        for (h, words) in all.iter().enumerate() {
            let dst = Array::contiguous(recv.addr + (h * n * recv.dtype.size()) as u64, recv.dtype, &[n]);
            elementwise::copy(&dst, &view(words, send.dtype, 0, n))?;
        }
        Ok(())
    }

    fn all_reduce(&self, group: &Group, send: &Array, recv: &Array, _: Stream) -> Result<()> {
        check(Collective::AllReduce, send, recv, self.members.len())?;
        let n = send.numel();
        let all = self.gather(group, send)?;
        let srcs: Vec<Array> = all.iter().map(|w| view(w, send.dtype, 0, n)).collect();
        sum_into(&Array::contiguous(recv.addr, recv.dtype, &[n]), &srcs)
    }

    fn reduce_scatter(&self, group: &Group, send: &Array, recv: &Array, _: Stream) -> Result<()> {
        check(Collective::ReduceScatter, send, recv, self.members.len())?;
        let n = recv.numel();
        let all = self.gather(group, send)?;
        let srcs: Vec<Array> = all.iter().map(|w| view(w, send.dtype, self.index * n, n)).collect();
        sum_into(&Array::contiguous(recv.addr, recv.dtype, &[n]), &srcs)
    }
}

/// NCCL's transport (the CUDA backend): a communicator over the members,
/// whose collectives are enqueued on the caller's stream.
pub struct NcclTransport {
    comm: Arc<Communicator>,
    members: Vec<usize>,
}

impl NcclTransport {
    pub fn new(comm: Communicator, members: Vec<usize>) -> NcclTransport {
        NcclTransport { comm: Arc::new(comm), members }
    }

    /// The communicator, for the group's watchdog to abort.
    pub fn communicator(&self) -> Arc<Communicator> {
        self.comm.clone()
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

    fn all_gather(&self, _: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()> {
        check(Collective::AllGather, send, recv, self.members.len())?;
        self.comm.all_gather(send.addr, recv.addr, send.numel() * send.dtype.size(), stream.0)
    }

    fn all_reduce(&self, _: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()> {
        check(Collective::AllReduce, send, recv, self.members.len())?;
        self.comm.all_reduce(send.addr, recv.addr, send.numel(), nccl_type(send.dtype)?, stream.0)
    }

    fn reduce_scatter(&self, _: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()> {
        check(Collective::ReduceScatter, send, recv, self.members.len())?;
        self.comm.reduce_scatter(send.addr, recv.addr, recv.numel(), nccl_type(send.dtype)?, stream.0)
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
                        let (r, n, f) = (g.rank(), 1000, DType::F32);
                        let dev = |b: &crate::backend::cuda::gpu_testing::DevBuf, len: usize| {
                            Array::contiguous(b.ptr, f, &[len])
                        };
                        let send: Vec<f32> = (0..n * m.len()).map(|i| value(r, i)).collect();
                        let sbuf = gpu.upload(&send);
                        let rbuf = gpu.upload(&vec![f32::NAN; n * m.len()]);
                        t.all_gather(g, &dev(&sbuf, n), &dev(&rbuf, n * m.len()), gpu.stream()).unwrap();
                        gpu.sync();
                        let want: Vec<f32> = m.iter().flat_map(|&p| (0..n).map(move |i| value(p, i))).collect();
                        assert_eq!(rbuf.read::<f32>(n * m.len()), want, "all-gather on rank {r}");
                        rbuf.write(&vec![f32::NAN; n * m.len()]);
                        t.all_reduce(g, &dev(&sbuf, n), &dev(&rbuf, n), gpu.stream()).unwrap();
                        gpu.sync();
                        let want: Vec<f32> = (0..n).map(|i| m.iter().map(|&p| value(p, i)).sum()).collect();
                        assert_eq!(rbuf.read::<f32>(n), want, "all-reduce on rank {r}");
                        rbuf.write(&vec![f32::NAN; n * m.len()]);
                        t.reduce_scatter(g, &dev(&sbuf, n * m.len()), &dev(&rbuf, n), gpu.stream()).unwrap();
                        gpu.sync();
                        let h = m.iter().position(|&p| p == r).unwrap();
                        let want: Vec<f32> = (0..n).map(|i| m.iter().map(|&p| value(p, h * n + i)).sum()).collect();
                        assert_eq!(rbuf.read::<f32>(n), want, "reduce-scatter on rank {r}");
                    }
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
