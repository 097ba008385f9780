//! A group: the ranks that share symmetric memory, their bootstrap, and the
//! backend this rank allocates on.
//!
//! Forming a group is collective: every rank announces who it is (host,
//! process, device, backend) and the group checks the announcements agree
//! before anything else happens, so a misconfigured rank fails every rank
//! with a message instead of corrupting data later.
//!
//! The settings that change what the ranks do together (the algorithm
//! override, the check-args mode) are agreed the same way: ranks whose
//! settings differ all fail with `Mismatch` naming the setting.
//!
//! What the layers above keep per group (the operations' scratch and
//! agreed calls, the registry of rendezvoused buffers) hangs off the group
//! as opaque [`Attachment`]s, so this module depends on none of them.
//!
//! A group fails for good at its first timeout, lost exchange, device
//! error, operation left half done, or abort, on any rank (see
//! `crate::health`): it then refuses every operation until destroyed.

mod across;

pub(crate) use across::{check as check_transport, Collective as TransportCollective};
pub use across::{AcrossHosts, Bootstrapped, NcclTransport};

use crate::backend::cuda::nccl::{self, Communicator};
use crate::backend::cuda::nccl_watch::Watchdog;
use crate::backend::host::{HostAllocation, HostMapping};
use crate::backend::{self, Allocation, Backend, BackendChoice, BackendKind, Mapping, Stream};
use crate::bootstrap::{allgather_var, Bootstrap};
use crate::config;
use crate::cost::Algorithm;
use crate::error::{err, Error, Result};
use crate::health::{Board, CallState, Health, SLOT_BYTES};
use crate::ipc;
use crate::logging::GroupScope;
use crate::sync::lock;
use crate::topology::Topology;
use crate::wire::{Reader, Writer};
use std::any::Any;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Default time any rank waits for the others.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Debug, Default)]
pub struct GroupConfig {
    /// `None`: take `SYMM_BACKEND`, else Auto.
    pub backend: Option<BackendChoice>,
    /// `None`: take `SYMM_TIMEOUT_MS`, else [`DEFAULT_TIMEOUT`].
    pub timeout: Option<Duration>,
    /// Let several ranks of the group use one device (tests, oversubscription).
    pub allow_shared_device: bool,
    /// Check that the ranks agree on every operation's arguments on every
    /// call, not only the first time a signature is seen (also forced by
    /// env `SYMM_CHECK_ARGS=always`).
    pub check_args_always: bool,
    /// The algorithm every fused operation runs unless a call chooses one;
    /// `None`: take `SYMM_ALGO`, else the cost model's choice.
    pub algorithm: Option<Algorithm>,
    /// The host identity this rank announces (ranks with different ones
    /// count as on different hosts); `None`: take `SYMM_HOST_ID`, else
    /// the hostname and boot id. Lets in-process tests place ranks on
    /// pretend hosts.
    pub host_id: Option<String>,
}

impl GroupConfig {
    pub fn resolved_timeout(&self) -> Result<Duration> {
        match self.timeout {
            Some(t) => Ok(t),
            None => Ok(config::timeout()?.unwrap_or(DEFAULT_TIMEOUT)),
        }
    }

    fn resolved_host_id(&self) -> String {
        self.host_id.clone().or_else(config::host_id).unwrap_or_else(host_identity)
    }

    fn resolved_backend(&self) -> Result<BackendChoice> {
        match self.backend {
            Some(b) => Ok(b),
            None => Ok(config::backend()?.unwrap_or(BackendChoice::Auto)),
        }
    }

    /// The settings this rank brings to the group (environment included).
    fn resolved_settings(&self) -> Result<Settings> {
        let algorithm = match self.algorithm {
            Some(a) => Some(a),
            None => config::algorithm()?,
        };
        let check_args_always = config::check_args_always()?.unwrap_or(self.check_args_always);
        Ok(Settings { algorithm, check_args_always })
    }
}

/// Group settings that change what the ranks do together, so every rank
/// must have the same (agreed when the group forms).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// The algorithm of every fused operation a call's options leave
    /// automatic (`SYMM_ALGO`); `None`: the cost model's.
    pub algorithm: Option<Algorithm>,
    /// Whether operations exchange their arguments on every call, not only
    /// the first time (`SYMM_CHECK_ARGS`): a rank that skips an exchange
    /// its peers make would leave them waiting.
    pub check_args_always: bool,
}

impl Settings {
    /// Each setting's name (as the user sets it) and value, for the
    /// announcement and the mismatch message.
    fn fields(&self) -> [(&'static str, String); 2] {
        [
            ("SYMM_ALGO", self.algorithm.map_or("auto", Algorithm::name).to_string()),
            (
                "SYMM_CHECK_ARGS (or SYMM_GROUP_CHECK_ARGS_ALWAYS)",
                if self.check_args_always { "always" } else { "cached" }.to_string(),
            ),
        ]
    }

    fn encode(&self, w: Writer) -> Writer {
        let code = self.algorithm.map_or(u8::MAX, |a| a as u8);
        w.u8(code).u8(self.check_args_always as u8)
    }

    fn decode(r: &mut Reader) -> Result<Settings> {
        let code = r.u8()?;
        let algorithm = match code {
            u8::MAX => None,
            c => Some(*Algorithm::ALL.get(c as usize).ok_or_else(|| err!(Internal, "malformed group announcement"))?),
        };
        Ok(Settings { algorithm, check_args_always: r.u8()? != 0 })
    }
}

/// State a layer above keeps per group, opaque to the group (the
/// operations' scratch buffers and agreed calls, the registry of
/// rendezvoused buffers).
pub trait Attachment: Any + Send + Sync {
    /// The caller gives the group up: drop whatever refers back to the
    /// group (its buffers hold the group), once the work issued so far no
    /// longer needs it.
    fn release(&self, group: &Group) {
        let _ = group;
    }
}

/// What each rank tells the others when the group forms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub host: String,
    pub pid: u32,
    pub device: i32,
    pub backend: BackendKind,
    pub settings: Settings,
    /// Whether the host was declared in the group config (a pretend host of
    /// an in-process test) rather than found or set by `SYMM_HOST_ID`.
    pub pretend_host: bool,
}

pub struct Group {
    rank: usize,
    world: usize,
    /// Milliseconds; adjustable after formation (`set_timeout`).
    timeout_ms: AtomicU64,
    backend: Arc<dyn Backend>,
    bootstrap: Box<dyn Bootstrap>,
    /// Serializes this rank's collectives: they must reach the bootstrap in
    /// the same order on every rank.
    collective: Mutex<()>,
    /// Shared by all ranks (rank 0's draw): authenticates fd requests.
    secret: [u8; 32],
    /// The group's id in log lines (from the secret, the same on every rank).
    log_id: u64,
    ranks: Vec<RankInfo>,
    topology: Topology,
    /// Groups spanning hosts: the transport over the ranks of this rank's
    /// local index (see [`AcrossHosts`]), and the one over the ranks of
    /// its host (the plans' level inside a host).
    across: Option<Box<dyn AcrossHosts>>,
    inside: Option<Box<dyn AcrossHosts>>,
    /// Groups spanning hosts through NCCL: aborts its communicators when a
    /// call outlives the timeout or the group fails.
    nccl_watch: Option<Watchdog>,
    settings: Settings,
    /// What the layers above keep per group (see [`Attachment`]), at most
    /// one of each type.
    attachments: Mutex<Vec<Arc<dyn Attachment>>>,
    /// Healthy, or failed for good (shared with the peers).
    health: Arc<Health>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("backend", &self.backend.kind())
            .finish()
    }
}

impl Group {
    /// Forms a group. Collective over `bootstrap`: every rank calls it.
    /// `device` is the CUDA ordinal this rank uses (ignored by the host backend).
    pub fn new(bootstrap: Box<dyn Bootstrap>, device: i32, cfg: &GroupConfig) -> Result<Arc<Group>> {
        let (rank, world) = (bootstrap.rank(), bootstrap.world());
        if world == 0 || world > backend::MAX_WORLD || rank >= world {
            return Err(err!(
                InvalidArgument,
                "rank {rank} of world {world}: need 0 <= rank < world <= {}",
                backend::MAX_WORLD
            ));
        }
        // A configuration error here must still reach the exchange below, so
        // the other ranks fail with a message instead of timing out.
        let timeout = cfg.resolved_timeout();
        let wait = *timeout.as_ref().unwrap_or(&DEFAULT_TIMEOUT);
        let settings = cfg.resolved_settings();
        let health = Arc::new(Health::new(rank));
        let local = timeout
            .and_then(|_| settings.clone())
            .and_then(|settings| Ok((settings, backend::select(cfg.resolved_backend()?, device, &health)?)));
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(|e| err!(System, "getrandom: {e}"))?;
        let payload = match &local {
            Ok((settings, b)) => Ok(encode_rank_info(
                rank,
                &RankInfo {
                    host: cfg.resolved_host_id(),
                    pid: std::process::id(),
                    device: b.device(),
                    backend: b.kind(),
                    settings: *settings,
                    pretend_host: cfg.host_id.is_some(),
                },
                &secret,
            )),
            Err(e) => Err(e.clone()),
        };
        let all = exchange(bootstrap.as_ref(), payload, wait, &|_| {})?;
        let (settings, backend) = local?;
        let mut ranks = Vec::with_capacity(world);
        let mut rank0_secret = [0u8; 32];
        for (r, bytes) in all.iter().enumerate() {
            let (announced, info, s) = decode_rank_info(bytes)?;
            if announced != r {
                return Err(err!(
                    Bootstrap,
                    "the bootstrap gave rank {announced}'s announcement in rank {r}'s place; does its all-gather \
                     gather every rank's bytes in rank order?"
                ));
            }
            if r == 0 {
                rank0_secret = s;
            }
            ranks.push(info);
        }
        let hosts: Vec<String> = ranks.iter().map(|r| r.host.clone()).collect();
        let topology = Topology::new(&hosts, rank);
        check_ranks(&ranks, &topology, rank, cfg.allow_shared_device)?;
        check_settings(&ranks)?;
        let (across, inside, nccl_watch) = match (topology.single_host(), backend.kind()) {
            (true, _) => (None, None, None),
            (false, BackendKind::Cuda) => {
                let (across, inside) = across_hosts(bootstrap.as_ref(), &topology, backend.device(), wait)?;
                let watch = watch_nccl(&health, backend.device(), &[&across, &inside])?;
                let boxed = |t: NcclTransport| Some(Box::new(t) as Box<dyn AcrossHosts>);
                (boxed(across), boxed(inside), Some(watch))
            }
            (false, BackendKind::Host) => {
                let across = Bootstrapped::new(across_members(&topology), rank)?;
                let inside = Bootstrapped::new(topology.local_ranks(), rank)?;
                (Some(Box::new(across) as Box<dyn AcrossHosts>), Some(Box::new(inside) as Box<dyn AcrossHosts>), None)
            }
        };
        health.attach_board(form_board(bootstrap.as_ref(), &topology, world, &rank0_secret, wait)?);
        if backend.kind() == BackendKind::Cuda {
            // Kernels cannot read the board: a thread tells them (see `Health`).
            watch_peers(&health);
        }
        Ok(Arc::new(Group {
            rank,
            world,
            timeout_ms: AtomicU64::new(wait.as_millis() as u64),
            backend,
            bootstrap,
            collective: Mutex::new(()),
            secret: rank0_secret,
            log_id: crate::logging::group_id(&rank0_secret),
            ranks,
            topology,
            across,
            inside,
            nccl_watch,
            settings,
            attachments: Mutex::default(),
            health,
        }))
    }

    /// Forms one group per entry of `devices` in this process (rank i on
    /// `devices[i]`), each on its own thread so that they can meet.
    pub fn new_local(devices: &[i32], cfg: &GroupConfig) -> Result<Vec<Arc<Group>>> {
        Self::new_local_with(devices, cfg, |_| std::thread::Builder::new())
    }

    /// [`Self::new_local`], rank r's thread made by `thread(r)`. A thread
    /// that cannot be started is a `System` error; the ranks wait until
    /// all are started, so that then none waits for it until the timeout.
    fn new_local_with(
        devices: &[i32],
        cfg: &GroupConfig,
        thread: impl Fn(usize) -> std::thread::Builder,
    ) -> Result<Vec<Arc<Group>>> {
        let bootstraps = crate::bootstrap::local::local_bootstraps(devices.len());
        let (gate, started) = (Mutex::new(()), AtomicBool::new(false));
        std::thread::scope(|s| {
            let open = lock(&gate);
            let mut joins = Vec::with_capacity(devices.len());
            let mut failed = None;
            for (r, (bs, &dev)) in bootstraps.into_iter().zip(devices).enumerate() {
                let (gate, started) = (&gate, &started);
                let rank = move || {
                    drop(lock(gate));
                    match started.load(Ordering::Relaxed) {
                        true => Group::new(Box::new(bs), dev, cfg),
                        false => Err(err!(System, "rank {r} of an in-process group: a peer's thread did not start")),
                    }
                };
                match thread(r).spawn_scoped(s, rank) {
                    Ok(j) => joins.push(j),
                    Err(e) => {
                        let n = devices.len();
                        failed = Some(err!(System, "cannot start the thread of rank {r} of {n} in-process ranks: {e}"));
                        break;
                    }
                }
            }
            // The gate's lock orders this store before the ranks' loads.
            started.store(failed.is_none(), Ordering::Relaxed);
            drop(open);
            let results: Vec<Result<Arc<Group>>> = joins
                .into_iter()
                .map(|j| j.join().unwrap_or_else(|_| Err(err!(Internal, "panic while forming an in-process group"))))
                .collect();
            if let Some(e) = failed {
                return Err(e);
            }
            // Report the root cause, not a peer's echo of it.
            let first = results.iter().position(|r| matches!(r, Err(e) if e.kind != crate::error::ErrorKind::Remote));
            match first.or_else(|| results.iter().position(Result::is_err)) {
                Some(i) => Err(results.into_iter().nth(i).unwrap().unwrap_err()),
                None => Ok(results.into_iter().map(Result::unwrap).collect()),
            }
        })
    }

    /// Reports an asynchronous failure (a device-side signal timeout),
    /// which fails the group.
    pub fn check_async_error(&self) -> Result<()> {
        self.backend.check_async_error().inspect_err(|e| self.fail(e))
    }

    /// `Err(Aborted)` quoting the first failure once the group failed, here
    /// or on a peer (asynchronous device errors included); call at the
    /// start of every operation.
    pub fn check_healthy(&self) -> Result<()> {
        self.health.check()?;
        if let Err(e) = self.backend.check_async_error() {
            self.fail(&e);
            return self.health.check();
        }
        Ok(())
    }

    /// Fails the group for good with `e` (first failure wins), telling the
    /// peers and ending this rank's waits.
    pub fn fail(&self, e: &Error) {
        self.health.fail(e)
    }

    /// Fails the group on purpose: every rank's pending waits end and later
    /// calls are refused. Takes no lock a blocked call may hold.
    pub fn abort(&self) {
        self.health.abort()
    }

    /// Posts where this rank stands with its collective call number `call`
    /// for the peers to see (`crate::health::CallState`); `false` where
    /// they cannot (a group spanning hosts).
    pub fn post_call(&self, call: u64, state: CallState) -> bool {
        self.topology.single_host() && self.health.post_call(call, state)
    }

    /// Where every rank stands with call number `call` (`None` for one not
    /// there yet); `None` where the ranks cannot see it (spanning hosts).
    pub fn calls(&self, call: u64) -> Option<Vec<Option<CallState>>> {
        self.topology.single_host().then(|| self.health.calls(call)).flatten()
    }

    /// The group's first failure, or `None` while it is healthy.
    pub fn failure(&self) -> Option<Error> {
        if let Err(e) = self.backend.check_async_error() {
            self.fail(&e);
        }
        self.health.cause()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }
    pub fn device(&self) -> i32 {
        self.backend.device()
    }
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }
    /// Changes how long this rank waits for the others from now on.
    pub fn set_timeout(&self, t: Duration) -> Result<()> {
        let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
        if ms == 0 {
            return Err(err!(InvalidArgument, "timeout must be positive"));
        }
        self.timeout_ms.store(ms, Ordering::Relaxed);
        Ok(())
    }
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    pub fn secret(&self) -> &[u8; 32] {
        &self.secret
    }
    pub fn ranks(&self) -> &[RankInfo] {
        &self.ranks
    }
    /// Which ranks share a host (see [`Topology`]).
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Takes the collective lock for a multi-step collective; while held,
    /// this thread's log lines name the group and rank.
    pub fn lock_collective(&self) -> Collective<'_> {
        Collective { _log: self.log_scope(), _lock: lock(&self.collective) }
    }

    /// Log lines of this thread name this group (an id every rank shares)
    /// and rank until the scope is dropped.
    pub fn log_scope(&self) -> GroupScope {
        GroupScope::enter(self.log_id, self.rank, self.world)
    }

    /// Collective: every rank offers its own result for `purpose`; all get
    /// every rank's payload if all succeeded, else an error (this rank's
    /// own, or `Remote` naming the rank that failed and why). Each payload
    /// carries its purpose, so ranks that reached different collectives
    /// (one reserving the workspace, one in a rendezvous; across hosts, one
    /// agreeing on a call while a peer moves a kept call's data through the
    /// bootstrap, see `crate::ops::agree`) fail with `Mismatch`, neither
    /// reading the other's bytes as its own. Call with the collective lock
    /// held.
    pub(crate) fn exchange(&self, purpose: Purpose, local: Result<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        self.health.check()?;
        let tag = purpose as u8;
        // Each payload says whose it is: a bootstrap (a caller's callback)
        // that hands back bytes out of rank order would otherwise map one
        // rank's buffer in another's place, or add the wrong rank's data.
        let head = [&[tag][..], &(self.rank() as u32).to_le_bytes()].concat();
        let tagged = local.map(|b| [&head[..], &b].concat());
        // A lost exchange leaves the ranks out of step: the group fails.
        let all = exchange(self.bootstrap.as_ref(), tagged, self.timeout(), &|e| self.fail(e))?;
        if let Some(r) = all.iter().position(|b| b.first() != Some(&tag)) {
            let theirs = all[r].first().and_then(|&t| Purpose::from_tag(t));
            let e = err!(
                Mismatch,
                "rank {r} made another call than this rank ({} there, {purpose:?} here): the ranks are out of step",
                theirs.map_or("an unknown one".to_string(), |p| format!("{p:?}"))
            );
            self.fail(&e);
            return Err(e);
        }
        let sender = |b: &[u8]| b.get(1..head.len()).map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")));
        if let Some(r) = all.iter().enumerate().position(|(r, b)| sender(b) != Some(r as u32)) {
            let e = err!(
                Bootstrap,
                "the bootstrap gave {} in rank {r}'s place ({purpose:?}); does its all-gather gather every rank's \
                 bytes in rank order?",
                sender(&all[r]).map_or("malformed bytes".to_string(), |s| format!("rank {s}'s bytes"))
            );
            self.fail(&e);
            return Err(e);
        }
        Ok(all.into_iter().map(|mut b| b.split_off(head.len())).collect())
    }

    /// `decoded`, the payloads an exchange returned as decoded: where one
    /// did not decode, the group fails, as the ranks no longer agree on
    /// what comes next.
    pub(crate) fn decoded<T>(&self, decoded: Result<T>) -> Result<T> {
        decoded.inspect_err(|e| self.fail(&e.clone().context("a peer's payload did not decode")))
    }

    /// Runs `enqueue`, a call's work across hosts on `stream` named `what`,
    /// under the NCCL watchdog where the group has one (see
    /// `crate::backend::cuda::nccl_watch`): if it runs on the GPU past the
    /// group's timeout, the group fails and NCCL's waits end.
    pub(crate) fn watched(
        &self,
        stream: Stream,
        what: &'static str,
        enqueue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        match &self.nccl_watch {
            Some(w) => w.watch(stream, what, self.timeout(), enqueue),
            None => enqueue(),
        }
    }

    /// The transport across hosts (`None` while the group is on one host).
    pub fn across_hosts(&self) -> Option<&dyn AcrossHosts> {
        self.across.as_deref()
    }

    /// The transport over the ranks of this rank's host, for the plans'
    /// level inside a host (`None` while the group is on one host).
    pub fn inside_host(&self) -> Option<&dyn AcrossHosts> {
        self.inside.as_deref()
    }

    /// The agreed settings (see [`Settings`]).
    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// Whether operations exchange their signature on every call.
    pub fn check_args_always(&self) -> bool {
        self.settings.check_args_always
    }

    /// This group's attachment of type `T`, made (by `T::default`) on
    /// first use.
    pub fn attachment<T: Attachment + Default>(&self) -> Arc<T> {
        let mut all = lock(&self.attachments);
        for a in all.iter() {
            let any: Arc<dyn Any + Send + Sync> = a.clone();
            if let Ok(t) = any.downcast::<T>() {
                return t;
            }
        }
        let t = Arc::new(T::default());
        all.push(t.clone());
        t
    }

    /// Releases what the layers above keep on this group (see
    /// [`Attachment::release`]). Called when the caller destroys the group.
    pub fn release_scratch(&self) {
        let all: Vec<Arc<dyn Attachment>> = lock(&self.attachments).clone();
        all.iter().for_each(|a| a.release(self));
    }
}

/// A held collective lock (see [`Group::lock_collective`]).
pub struct Collective<'a> {
    _log: GroupScope,
    _lock: MutexGuard<'a, ()>,
}

/// See [`Group::exchange`]; `lost` sees the error of an all-gather that
/// failed (as opposed to a rank's reported failure).
fn exchange(
    bs: &dyn Bootstrap,
    local: Result<Vec<u8>>,
    timeout: Duration,
    lost: &dyn Fn(&Error),
) -> Result<Vec<Vec<u8>>> {
    let msg = match &local {
        Ok(p) => Writer::new().u8(0).bytes(p).finish(),
        Err(e) => Writer::new().u8(1).str(&e.msg).finish(),
    };
    let all = allgather_var(bs, &msg, timeout).inspect_err(|e| lost(e))?;
    local?;
    let mut out = Vec::with_capacity(all.len());
    let mut failures = Vec::new();
    for (r, m) in all.iter().enumerate() {
        let mut rd = Reader::new(m, "collective status");
        if rd.u8()? == 0 {
            out.push(rd.bytes()?.to_vec());
        } else {
            failures.push(format!("rank {r}: {}", rd.str()?));
        }
    }
    if failures.is_empty() {
        Ok(out)
    } else {
        Err(err!(Remote, "another rank failed: {}", failures.join("; ")))
    }
}

/// Collective: the group's board of failures (see `crate::health`). The
/// first rank of each host makes one in shared memory and publishes its fd
/// as buffers are (group secret, fd server); every other rank of that host
/// maps it (one board per host: failures reach the ranks of one host). A
/// second exchange keeps the fds published until every rank holds its
/// host's, and fails every rank if one could not map it.
fn form_board(
    bs: &dyn Bootstrap,
    topology: &Topology,
    world: usize,
    secret: &[u8; 32],
    timeout: Duration,
) -> Result<Board> {
    let leader = topology.local_ranks()[0];
    let bytes = world * SLOT_BYTES;
    let make = || -> Result<(HostAllocation, ipc::Publication, Vec<u8>)> {
        let alloc = HostAllocation::new(bytes)?;
        let server = ipc::fd_server()?;
        let mut token = [0u8; 8];
        getrandom::fill(&mut token).map_err(|e| err!(System, "getrandom: {e}"))?;
        let token = u64::from_le_bytes(token);
        let publication = server.publish(token, *secret, alloc.export_fd()?.as_fd())?;
        Ok((alloc, publication, Writer::new().u64(token).bytes(server.name()).finish()))
    };
    let made = if bs.rank() == leader { make().map(Some) } else { Ok(None) };
    let payload = match &made {
        Ok(Some((_, _, announce))) => Ok(announce.clone()),
        Ok(None) => Ok(Vec::new()),
        Err(e) => Err(e.clone()),
    };
    let all = exchange(bs, payload, timeout, &|_| {})?;
    let (board, _publication) = match made? {
        Some((alloc, publication, _)) => {
            (Ok(Board::new(alloc.addr() as usize, world, Box::new(alloc))), Some(publication))
        }
        None => {
            let fetch = || -> Result<Board> {
                let mut r = Reader::new(&all[leader], "health board announcement");
                let token = r.u64()?;
                let server = r.bytes()?;
                let fd = ipc::fetch_fd(server, token, secret, timeout)
                    .map_err(|e| e.context(format!("fetching the group's health board from rank {leader}")))?;
                let m = HostMapping::import(fd, bytes)?;
                Ok(Board::new(m.addr() as usize, world, Box::new(m)))
            };
            (fetch(), None)
        }
    };
    exchange(bs, board.as_ref().map(|_| Vec::new()).map_err(Clone::clone), timeout, &|_| {})?;
    board
}

/// A thread that looks at the board for the peers' failures, so that a
/// failed peer also stops this rank's kernels (the failure wakes them).
/// It ends when the group fails or is gone.
fn watch_peers(health: &Arc<Health>) {
    let weak = Arc::downgrade(health);
    let watch = move || loop {
        std::thread::sleep(Duration::from_millis(10));
        match weak.upgrade() {
            Some(h) if h.cause().is_none() => {}
            _ => return,
        }
    };
    if let Err(e) = std::thread::Builder::new().name("symm-health".into()).spawn(watch) {
        log::warn!(
            "no thread to watch the peers' failures ({e}); kernels waiting for a failed peer wait until their timeout"
        );
    }
}

/// Rank `rank`'s announcement; the rank in it lets the group see a
/// bootstrap that gathers the ranks' bytes out of order.
fn encode_rank_info(rank: usize, m: &RankInfo, secret: &[u8; 32]) -> Vec<u8> {
    let w = Writer::new()
        .u32(rank as u32)
        .str(&m.host)
        .u8(m.pretend_host as u8)
        .u32(m.pid)
        .u32(m.device as u32)
        .str(m.backend.name())
        .bytes(secret);
    m.settings.encode(w).finish()
}

/// An announcement: the rank that made it, what it says, the secret.
fn decode_rank_info(b: &[u8]) -> Result<(usize, RankInfo, [u8; 32])> {
    let mut r = Reader::new(b, "group announcement");
    let rank = r.u32()? as usize;
    let host = r.str()?;
    let pretend_host = r.u8()? != 0;
    let pid = r.u32()?;
    let device = r.u32()? as i32;
    let backend = match r.str()?.as_str() {
        "cuda" => BackendKind::Cuda,
        _ => BackendKind::Host,
    };
    let secret: [u8; 32] = r.bytes()?.try_into().map_err(|_| err!(Internal, "malformed group secret"))?;
    let settings = Settings::decode(&mut r)?;
    Ok((rank, RankInfo { host, pretend_host, pid, device, backend, settings }, secret))
}

/// Collective, for a group that spans hosts: every rank loads NCCL (any
/// rank's failure fails all), then joins a communicator over the ranks of
/// its local index (its transport across hosts) and one over the ranks of
/// its host (the level inside a host, where its steps do not take
/// symmetric memory). Only the CUDA backend gets here.
fn across_hosts(
    bs: &dyn Bootstrap,
    topology: &Topology,
    device: i32,
    wait: Duration,
) -> Result<(NcclTransport, NcclTransport)> {
    let loaded = nccl::load();
    exchange(bs, loaded.as_ref().map(|_| Vec::new()).map_err(Clone::clone), wait, &|_| {})?;
    let nccl = loaded?;
    log::info!(
        "the group spans {} hosts (this rank is local rank {} of {} on its host): NCCL {} from {}",
        topology.hosts(),
        topology.local_rank(),
        topology.local_world(),
        nccl.version_string(),
        nccl.path()
    );
    let across = join_nccl(bs, nccl, across_members(topology), device, wait, "across hosts")?;
    let inside = join_nccl(bs, nccl, topology.local_ranks(), device, wait, "inside its host")?;
    Ok((across, inside))
}

/// Collective over the whole group (every rank calls it, each with its own
/// `members`, sets that partition the group): joins a communicator over
/// `members`, whose first member draws the id, which travels through the
/// bootstrap.
fn join_nccl(
    bs: &dyn Bootstrap,
    nccl: &'static nccl::Nccl,
    members: Vec<usize>,
    device: i32,
    wait: Duration,
    what: &str,
) -> Result<NcclTransport> {
    let index = members.iter().position(|&m| m == bs.rank()).unwrap_or(0);
    let mine = if index == 0 { nccl.unique_id().map(|id| id.internal.to_vec()) } else { Ok(Vec::new()) };
    let ids = exchange(bs, mine, wait, &|_| {})?;
    let id = nccl::UniqueId::from_bytes(&ids[members[0]])?;
    let comm = Communicator::join(nccl, index, members.len(), device, id)
        .map_err(|e| e.context(format!("joining the ranks {members:?} {what}")))?;
    let context = format!("the call tags of the ranks {members:?} {what}");
    NcclTransport::new(comm, members).map_err(|e| e.context(context))
}

/// What an exchange through the bootstrap is for (its tag, see
/// [`Group::exchange`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// The arguments of a call (`crate::ops::agree`).
    Agreement = 1,
    /// A collective's data (the bootstrap's transport across hosts).
    Data = 2,
    /// A rendezvous's announcement of each rank's buffer.
    Announce = 3,
    /// A rendezvous's confirmation that every rank mapped its peers.
    Mapped = 4,
    /// The size of the workspace to reserve (`symm_group_reserve_workspace`).
    Reserve = 5,
}

impl Purpose {
    fn from_tag(tag: u8) -> Option<Purpose> {
        [Purpose::Agreement, Purpose::Data, Purpose::Announce, Purpose::Mapped, Purpose::Reserve]
            .into_iter()
            .find(|&p| p as u8 == tag)
    }
}

/// The watchdog of a group's NCCL communicators: it fails the group (held
/// weakly: the group owns the watchdog) and hears of its failures.
fn watch_nccl(health: &Arc<Health>, device: i32, transports: &[&NcclTransport]) -> Result<Watchdog> {
    let weak = Arc::downgrade(health);
    let fail = Box::new(move |e: &Error| {
        if let Some(h) = weak.upgrade() {
            h.fail(e)
        }
    });
    let watch = Watchdog::start(device, transports.iter().map(|t| t.communicator()).collect(), fail)?;
    health.on_failure(watch.group_failed());
    Ok(watch)
}

/// The ranks with this rank's local index on every host, in host order:
/// the members of its transport across hosts. Hosts without a rank of
/// that index have no member.
fn across_members(topology: &Topology) -> Vec<usize> {
    let local = topology.local_rank();
    (0..topology.hosts()).filter_map(|h| topology.ranks_on(h).get(local).copied()).collect()
}

/// Every rank must use the same backend; CUDA ranks on one host must not
/// share a device (unless allowed). Ranks on different hosts need the CUDA
/// backend (the host backend's memory is shared memory of one host), except
/// pretend hosts of in-process tests, declared on every rank, which the
/// host backend joins through its bootstrap.
fn check_ranks(ranks: &[RankInfo], topology: &Topology, me: usize, allow_shared_device: bool) -> Result<()> {
    let mine = &ranks[me];
    for (r, info) in ranks.iter().enumerate() {
        if info.backend != mine.backend {
            return Err(err!(
                Mismatch,
                "rank {r} uses the {} backend and rank {me} the {}; set the same backend on every rank (SYMM_BACKEND)",
                info.backend.name(),
                mine.backend.name()
            ));
        }
    }
    let pretend = ranks.iter().all(|r| r.pretend_host);
    if mine.backend == BackendKind::Host && !topology.single_host() && !pretend {
        // Every rank sees the same topology: name the same two ranks everywhere.
        let other = (0..ranks.len()).find(|&r| topology.host_of(r) != topology.host_of(0)).unwrap_or(0);
        return Err(err!(
            Unsupported,
            "rank 0 runs on host {:?} and rank {other} on {:?}: the host backend shares memory within one host, \
             and a group spanning hosts needs the CUDA backend and NCCL",
            ranks[0].host,
            ranks[other].host
        ));
    }
    if mine.backend == BackendKind::Cuda && !allow_shared_device {
        for (a, x) in ranks.iter().enumerate() {
            for (b, y) in ranks.iter().enumerate().skip(a + 1) {
                if x.device == y.device && topology.host_of(a) == topology.host_of(b) {
                    return Err(err!(Mismatch, "ranks {a} and {b} both use CUDA device {}; give each rank its own device or allow shared devices in the group config", x.device));
                }
            }
        }
    }
    Ok(())
}

/// Every rank's settings against rank 0's, so that every rank reports the
/// same message.
fn check_settings(ranks: &[RankInfo]) -> Result<()> {
    let first = ranks[0].settings.fields();
    for (r, info) in ranks.iter().enumerate().skip(1) {
        for ((name, want), (_, got)) in first.iter().zip(info.settings.fields()) {
            if *want != got {
                return Err(err!(
                    Mismatch,
                    "{name} is {want} on rank 0 but {got} on rank {r}; set it alike on every rank"
                ));
            }
        }
    }
    Ok(())
}

/// Identifies this host (and boot), so ranks can tell whether IPC reaches:
/// containers on one host share the boot id.
fn host_identity() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    format!("{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CallTag;
    use crate::bootstrap::local::local_bootstraps;
    use crate::error::ErrorKind;

    fn host_cfg() -> GroupConfig {
        GroupConfig { backend: Some(BackendChoice::Host), timeout: Some(Duration::from_secs(5)), ..Default::default() }
    }

    /// A rank whose thread cannot start (a stack no process can map) fails
    /// the in-process group with `System` at once, without a panic, and
    /// without the started ranks waiting for it until the timeout.
    #[test]
    fn a_local_rank_that_cannot_start_is_a_system_error() {
        let cfg = GroupConfig { timeout: Some(Duration::from_secs(60)), ..host_cfg() };
        let t = std::time::Instant::now();
        let e = Group::new_local_with(&[0; 4], &cfg, |r| match r {
            2 => std::thread::Builder::new().stack_size(1 << 60),
            _ => std::thread::Builder::new(),
        })
        .unwrap_err();
        assert_eq!(e.kind, ErrorKind::System, "{e}");
        assert!(e.msg.starts_with("cannot start the thread of rank 2 of 4 in-process ranks: "), "{e}");
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    }

    /// A rank's announcement in another's place (a caller's bootstrap that
    /// gathers out of order, or hands back one rank's bytes twice) is a
    /// `Bootstrap` error on every rank, not a group whose calls time out.
    /// A caller's faulty bootstrap: a local one whose gathered bytes pass
    /// through `.1` (with each rank's length).
    struct Rewriting<F>(crate::bootstrap::local::LocalBootstrap, F);

    impl<F: Fn(Vec<u8>, usize) -> Vec<u8> + Send + Sync> Bootstrap for Rewriting<F> {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world(&self) -> usize {
            self.0.world()
        }
        fn allgather(&self, data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
            Ok((self.1)(self.0.allgather(data, timeout)?, data.len()))
        }
    }

    #[test]
    fn announcements_out_of_place_are_a_bootstrap_error() {
        let cloned = |all: Vec<u8>, n: usize| all[..n].repeat(2); // rank 0's bytes everywhere
        let res: Vec<Result<Arc<Group>>> = std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(2)
                .into_iter()
                .map(|b| s.spawn(move || Group::new(Box::new(Rewriting(b, cloned)), 0, &host_cfg())))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for e in res.iter().map(|r| r.as_ref().unwrap_err()) {
            assert_eq!(e.kind, ErrorKind::Bootstrap, "{e}");
            assert!(e.msg.contains("rank 0's announcement in rank 1's place"), "{e}");
        }
    }

    /// A bootstrap that turns to handing back the ranks' bytes out of
    /// order after the group formed: the next exchange (a workspace's
    /// reservation here) is a `Bootstrap` error on every rank, not a
    /// mapping of one rank's memory in another's place.
    #[test]
    fn exchanges_out_of_rank_order_are_a_bootstrap_error() {
        let reverse = Arc::new(AtomicBool::new(false));
        let groups: Vec<Arc<Group>> = std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(2)
                .into_iter()
                .map(|b| {
                    let reverse = reverse.clone();
                    let reversing = move |all: Vec<u8>, n: usize| match reverse.load(Ordering::SeqCst) {
                        true => all.chunks(n.max(1)).rev().flatten().copied().collect(),
                        false => all,
                    };
                    s.spawn(move || Group::new(Box::new(Rewriting(b, reversing)), 0, &host_cfg()).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        reverse.store(true, Ordering::SeqCst);
        let errors: Vec<Error> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .iter()
                .map(|g| s.spawn(move || g.exchange(Purpose::Reserve, Ok(vec![7; 8])).unwrap_err()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, e) in errors.iter().enumerate() {
            assert_eq!(e.kind, ErrorKind::Bootstrap, "{e}");
            assert!(e.msg.contains("rank 1's bytes in rank 0's place"), "rank {r}: {e}");
        }
        assert!(groups.iter().all(|g| g.health.check().is_err()), "the groups failed");
    }

    #[test]
    fn forms_group_and_shares_rank0_secret() {
        let groups: Vec<Arc<Group>> = std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(3)
                .into_iter()
                .map(|b| s.spawn(move || Group::new(Box::new(b), 0, &host_cfg()).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(groups[2].rank(), 2);
        assert_eq!(groups[0].world(), 3);
        assert_eq!(groups[0].secret(), groups[2].secret());
        assert_eq!(groups[1].backend().kind(), BackendKind::Host);
    }

    #[test]
    fn one_rank_failing_fails_all_with_its_reason() {
        let res: Vec<Result<Arc<Group>>> = std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(2)
                .into_iter()
                .enumerate()
                .map(|(r, b)| {
                    s.spawn(move || {
                        let mut cfg = host_cfg();
                        if r == 1 {
                            cfg.backend = Some(BackendChoice::Cuda);
                        }
                        Group::new(Box::new(b), 7, &cfg)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let e0 = res[0].as_ref().unwrap_err();
        assert_eq!(e0.kind, ErrorKind::Remote);
        assert!(e0.msg.contains("rank 1"), "{}", e0.msg);
        assert_ne!(res[1].as_ref().unwrap_err().kind, ErrorKind::Remote);
    }

    #[test]
    fn parse_backend() {
        assert_eq!(BackendChoice::parse("HOST").unwrap(), BackendChoice::Host);
        assert_eq!(BackendChoice::parse("cuda").unwrap(), BackendChoice::Cuda);
        assert!(BackendChoice::parse("tpu").is_err());
    }

    #[test]
    fn shared_device_rejected_for_cuda() {
        let info = |d| RankInfo {
            host: "h".into(),
            pid: 1,
            device: d,
            backend: BackendKind::Cuda,
            settings: Settings::default(),
            pretend_host: false,
        };
        let ranks = vec![info(0), info(0)];
        let one = Topology::new(&["h".into(), "h".into()], 0);
        assert_eq!(check_ranks(&ranks, &one, 0, false).unwrap_err().kind, ErrorKind::Mismatch);
        assert!(check_ranks(&ranks, &one, 0, true).is_ok());
        // The same ordinal on two hosts is two devices.
        let two = Topology::new(&["h".into(), "g".into()], 0);
        assert!(check_ranks(&ranks, &two, 0, false).is_ok());
    }

    /// Forms a host-backend group of `world` ranks, rank r announcing
    /// host `hosts[r]`.
    fn form_on_hosts(hosts: &[&str]) -> Vec<Result<Arc<Group>>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(hosts.len())
                .into_iter()
                .zip(hosts)
                .map(|(b, h)| {
                    let cfg = GroupConfig { host_id: Some(h.to_string()), ..host_cfg() };
                    s.spawn(move || Group::new(Box::new(b), 0, &cfg))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The host backend cannot span real hosts: every rank refuses alike
    /// (the same two ranks named everywhere), before any waits for a peer.
    #[test]
    fn host_backend_refuses_groups_spanning_hosts() {
        for hosts in [&["a", "b"][..], &["a", "a", "b"], &["a", "b", "a", "c"]] {
            let ranks: Vec<RankInfo> = hosts
                .iter()
                .map(|h| RankInfo {
                    host: h.to_string(),
                    pretend_host: false,
                    pid: 1,
                    device: 0,
                    backend: BackendKind::Host,
                    settings: Settings::default(),
                })
                .collect();
            let ids: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
            for me in 0..hosts.len() {
                let e = check_ranks(&ranks, &Topology::new(&ids, me), me, false).expect_err("ranks on different hosts");
                assert_eq!(e.kind, ErrorKind::Unsupported);
                assert!(
                    e.msg.starts_with("rank 0 runs on host \"a\" and rank 1 on \"b\"")
                        || e.msg.starts_with("rank 0 runs on host \"a\" and rank 2 on \"b\""),
                    "{}",
                    e.msg
                );
                assert!(e.msg.contains("needs the CUDA backend and NCCL"), "{}", e.msg);
                // Pretend hosts declared on every rank form (see below).
                let pretend: Vec<RankInfo> =
                    ranks.iter().map(|r| RankInfo { pretend_host: true, ..r.clone() }).collect();
                assert!(check_ranks(&pretend, &Topology::new(&ids, me), me, false).is_ok());
            }
        }
    }

    /// Pretend hosts on the host backend: the group forms, with a
    /// transport across hosts over the ranks of each local index and one
    /// inside each host over its ranks; the group's own exchanges reach
    /// every rank, tagged, so one that meets an exchange of a call's data
    /// fails both ranks.
    #[test]
    fn pretend_hosts_form_with_a_transport() {
        for hosts in [&["a", "b"][..], &["a", "b", "a", "b"], &["a", "a", "b", "b"], &["a", "b", "c", "d"]] {
            let start = std::time::Instant::now();
            let groups: Vec<Arc<Group>> = form_on_hosts(hosts).into_iter().map(Result::unwrap).collect();
            for g in &groups {
                let members = g.across_hosts().expect("spans hosts").members().to_vec();
                assert!(members.contains(&g.rank()));
                let mut on: Vec<&str> = members.iter().map(|&m| hosts[m]).collect();
                on.dedup();
                assert_eq!(on.len(), g.topology().hosts());
                assert!(members.iter().all(|&m| groups[m].topology().local_rank() == g.topology().local_rank()));
                assert_eq!(g.inside_host().expect("spans hosts").members(), g.topology().local_ranks());
            }
            std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .iter()
                    .enumerate()
                    .map(|(r, g)| s.spawn(move || g.exchange(Purpose::Data, Ok(vec![r as u8]))))
                    .collect();
                for h in hs {
                    let all = h.join().unwrap().unwrap();
                    assert_eq!(all, (0..hosts.len()).map(|r| vec![r as u8]).collect::<Vec<_>>());
                }
            });
            assert!(start.elapsed() < Duration::from_secs(4), "took {:?}", start.elapsed());
        }
        for g in form_on_hosts(&["x", "x"]) {
            let g = g.unwrap();
            assert!(g.across_hosts().is_none() && g.inside_host().is_none());
        }
    }

    /// The bootstrap's transport: every rank's collective over its members
    /// against a reference computed from every rank's input, in f32 and
    /// wrapping int8, poisoned outputs.
    #[test]
    fn bootstrap_transport_collectives() {
        use crate::array::{Array, DType};
        use crate::backend::Stream;
        let value = |r: usize, i: usize| (r * 10 + i) as f32 - 7.5;
        for hosts in [&["a", "b"][..], &["a", "b", "b", "a"], &["a", "b", "c"], &["a", "a", "b", "b"]] {
            let groups: Vec<Arc<Group>> = form_on_hosts(hosts).into_iter().map(Result::unwrap).collect();
            std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .iter()
                    .map(|g| {
                        s.spawn(move || {
                            let _lock = g.lock_collective();
                            let t = g.across_hosts().unwrap();
                            let m = t.members().to_vec();
                            let n = 5;
                            let (r, f, tag) = (g.rank(), DType::F32, CallTag::of(b"collectives"));
                            let arr = |v: &Vec<f32>| Array::contiguous(v.as_ptr() as u64, f, &[v.len()]);
                            // All-gather.
                            let send: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                            let recv = vec![f32::NAN; n * m.len()];
                            t.all_gather(g, &arr(&send), &arr(&recv), Stream(0), tag).unwrap();
                            let want: Vec<f32> = m.iter().flat_map(|&p| (0..n).map(move |i| value(p, i))).collect();
                            assert_eq!(recv, want, "all-gather on rank {r}");
                            // All-reduce.
                            let recv = vec![f32::NAN; n];
                            t.all_reduce(g, &arr(&send), &arr(&recv), Stream(0), tag).unwrap();
                            let want: Vec<f32> = (0..n).map(|i| m.iter().map(|&p| value(p, i)).sum()).collect();
                            assert_eq!(recv, want, "all-reduce on rank {r}");
                            // Reduce-scatter: block h of `send` is meant for member h.
                            let send: Vec<f32> = (0..n * m.len()).map(|i| value(r, i)).collect();
                            let recv = vec![f32::NAN; n];
                            t.reduce_scatter(g, &arr(&send), &arr(&recv), Stream(0), tag).unwrap();
                            let h = m.iter().position(|&p| p == r).unwrap();
                            let want: Vec<f32> = (0..n).map(|i| m.iter().map(|&p| value(p, h * n + i)).sum()).collect();
                            assert_eq!(recv, want, "reduce-scatter on rank {r}");
                            // Integers wrap.
                            let send = vec![100i8 + r as i8; 3];
                            let recv = vec![-1i8; 3];
                            let a8 = |v: &Vec<i8>| Array::contiguous(v.as_ptr() as u64, DType::I8, &[3]);
                            t.all_reduce(g, &a8(&send), &a8(&recv), Stream(0), tag).unwrap();
                            let sum = m.iter().fold(0i8, |s, &p| s.wrapping_add(100 + p as i8));
                            assert_eq!(recv, vec![sum; 3], "int8 all-reduce on rank {r}");
                            // Missized buffers are refused before anything moves.
                            let e = t.all_reduce(g, &a8(&send), &arr(&vec![0f32; 3]), Stream(0), tag).unwrap_err();
                            assert_eq!(e.kind, ErrorKind::Internal);
                        })
                    })
                    .collect();
                hs.into_iter().for_each(|h| h.join().unwrap());
            });
        }
    }

    /// A member in another call (another tag) fails the step on every rank
    /// with `Mismatch` naming a rank across hosts, writes nothing, and
    /// fails the group.
    #[test]
    fn bootstrap_transport_refuses_another_call_s_tag() {
        use crate::array::{Array, DType};
        use crate::backend::Stream;
        let groups: Vec<Arc<Group>> = form_on_hosts(&["a", "b"]).into_iter().map(Result::unwrap).collect();
        std::thread::scope(|s| {
            for g in &groups {
                s.spawn(move || {
                    let _lock = g.lock_collective();
                    let t = g.across_hosts().unwrap();
                    let send = [1.5f32, 2.5];
                    let recv = [f32::NAN; 4];
                    let arr = |p: *const f32, n: usize| Array::contiguous(p as u64, DType::F32, &[n]);
                    let tag = CallTag::of(if g.rank() == 0 { b"one call" } else { b"another" });
                    let e =
                        t.all_gather(g, &arr(send.as_ptr(), 2), &arr(recv.as_ptr(), 4), Stream(0), tag).unwrap_err();
                    assert_eq!(e.kind, ErrorKind::Mismatch, "{}", e.msg);
                    let peer = 1 - g.rank();
                    assert!(
                        e.msg.contains(&format!("exchange across hosts: rank {peer} is making a different call")),
                        "{}",
                        e.msg
                    );
                    assert!(recv.iter().all(|v| v.is_nan()), "rank {}: written", g.rank());
                    assert_eq!(g.failure().map(|e| e.kind), Some(ErrorKind::Mismatch));
                });
            }
        });
    }

    /// One pretend host: the group forms as any other, its topology one host.
    #[test]
    fn one_named_host_forms() {
        for world in 1..=4 {
            let groups: Vec<Arc<Group>> = form_on_hosts(&vec!["x"; world]).into_iter().map(Result::unwrap).collect();
            for (r, g) in groups.iter().enumerate() {
                let t = g.topology();
                assert_eq!((t.hosts(), t.host_of(r), t.local_rank(), t.local_world()), (1, Some(0), r, world));
                assert_eq!(t.local_ranks(), (0..world).collect::<Vec<_>>());
            }
            // Collectives run as in any group.
            std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .iter()
                    .enumerate()
                    .map(|(r, g)| s.spawn(move || g.exchange(Purpose::Data, Ok(vec![r as u8]))))
                    .collect();
                for h in hs {
                    assert_eq!(h.join().unwrap().unwrap(), (0..world as u8).map(|r| vec![r]).collect::<Vec<_>>());
                }
            });
        }
    }

    /// Where NCCL is missing (as in CI), a group spanning hosts fails on
    /// every rank with the message saying where NCCL comes from.
    #[test]
    fn spanning_hosts_without_nccl_fails_every_rank() {
        if nccl::load().is_ok() {
            eprintln!("NCCL is installed here: the communicator is a GPU test");
            return;
        }
        let res: Vec<Result<(NcclTransport, NcclTransport)>> = std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(3)
                .into_iter()
                .enumerate()
                .map(|(r, b)| {
                    s.spawn(move || {
                        let ids = ["a".to_string(), "b".into(), "b".into()];
                        across_hosts(&b, &Topology::new(&ids, r), 0, Duration::from_secs(5))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in res {
            let e = r.err().expect("no NCCL");
            assert_eq!(e.kind, ErrorKind::Unsupported);
            assert!(e.msg.starts_with("a group spanning hosts needs NCCL"), "{}", e.msg);
            assert!(e.msg.contains("SYMM_NCCL_LIBRARY"), "{}", e.msg);
        }
    }

    /// Ranks whose settings differ all fail with `Mismatch` naming the
    /// setting; alike, the group keeps them.
    #[test]
    fn differing_settings_fail_every_rank() {
        let form = |algos: [Option<Algorithm>; 2], always: [bool; 2]| -> Vec<Result<Arc<Group>>> {
            std::thread::scope(|s| {
                let hs: Vec<_> = local_bootstraps(2)
                    .into_iter()
                    .enumerate()
                    .map(|(r, b)| {
                        let cfg = GroupConfig { algorithm: algos[r], check_args_always: always[r], ..host_cfg() };
                        s.spawn(move || Group::new(Box::new(b), 0, &cfg))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let (seq, pip) = (Some(Algorithm::Sequential), Some(Algorithm::Pipelined));
        for (algos, always, name) in [
            ([seq, pip], [false; 2], "SYMM_ALGO is sequential on rank 0 but pipelined on rank 1"),
            ([None, seq], [false; 2], "SYMM_ALGO is auto on rank 0 but sequential on rank 1"),
            ([None; 2], [true, false], "SYMM_CHECK_ARGS (or SYMM_GROUP_CHECK_ARGS_ALWAYS) is always on rank 0"),
        ] {
            for res in form(algos, always) {
                let e = res.expect_err("differing settings");
                assert_eq!(e.kind, ErrorKind::Mismatch);
                assert!(e.msg.contains(name), "{}", e.msg);
            }
        }
        for g in form([pip; 2], [true; 2]) {
            let g = g.unwrap();
            assert_eq!(g.settings(), Settings { algorithm: pip, check_args_always: true });
        }
    }
}
