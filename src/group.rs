//! A group: the ranks that share symmetric memory, their bootstrap, and the
//! backend this rank allocates on.
//!
//! Forming a group is collective: every rank announces who it is (host,
//! process, device, backend) and the group checks the announcements agree
//! before anything else happens, so a misconfigured rank fails every rank
//! with a message instead of corrupting data later.
//!
//! A group also keeps what its operations share between calls: the
//! symmetric workspace they move data through, the rendezvoused buffers an
//! operation may use in place, and the call signatures all ranks agreed on.

use crate::backend::{self, Backend, BackendChoice, BackendKind};
use crate::bootstrap::{allgather_var, Bootstrap};
use crate::buffer::Handle;
use crate::error::{err, Result};
use crate::wire::{Reader, Writer};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// Default time any rank waits for the others.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The symmetric buffers the operations layer keeps per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scratch {
    /// Staging and scratch that every call reuses.
    Workspace = 0,
    /// The fused reduce-scatter's inboxes, which the peers' kernels push
    /// into: no other work may write this memory.
    Mailbox = 1,
    /// The fused reduce-scatter's state: the count of calls (which lets
    /// one call follow another with no barrier) and the tile flags, every
    /// word an epoch no later than the last call's, whatever the shape.
    /// A buffer of its own: laid out by the call's shape in the mailbox,
    /// one shape's flags lay where another shape's peers had pushed
    /// partials, which then read as flags already set.
    Flags = 2,
}

impl Scratch {
    const COUNT: usize = 3;
}

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
}

impl GroupConfig {
    pub fn resolved_timeout(&self) -> Result<Duration> {
        if let Some(t) = self.timeout {
            return Ok(t);
        }
        match std::env::var("SYMM_TIMEOUT_MS") {
            Ok(v) => v.trim().parse::<u64>().ok().filter(|&ms| ms > 0).map(Duration::from_millis).ok_or_else(|| {
                err!(InvalidArgument, "SYMM_TIMEOUT_MS={v:?}: expected a positive number of milliseconds")
            }),
            Err(_) => Ok(DEFAULT_TIMEOUT),
        }
    }

    fn resolved_check_args_always(&self) -> Result<bool> {
        match std::env::var("SYMM_CHECK_ARGS") {
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "always" => Ok(true),
                "" | "cached" => Ok(self.check_args_always),
                _ => Err(err!(InvalidArgument, "SYMM_CHECK_ARGS={v:?}: expected always or cached")),
            },
            Err(_) => Ok(self.check_args_always),
        }
    }

    fn resolved_backend(&self) -> Result<BackendChoice> {
        match (self.backend, std::env::var("SYMM_BACKEND")) {
            (Some(b), _) => Ok(b),
            (None, Ok(v)) => BackendChoice::parse(&v),
            (None, Err(_)) => Ok(BackendChoice::Auto),
        }
    }
}

/// What each rank tells the others when the group forms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub host: String,
    pub pid: u32,
    pub device: i32,
    pub backend: BackendKind,
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
    ranks: Vec<RankInfo>,
    check_args_always: bool,
    /// Signatures of calls all ranks agreed on, so that repeats skip the
    /// exchange. Every rank inserts and clears in the same order (inserts
    /// follow an exchange all ranks took part in), so the sets stay equal.
    agreed: Mutex<HashSet<Vec<u8>>>,
    /// Calls the operations layer prepared (checked, agreed, planned), by a
    /// hash of their arguments; opaque here. Each stands for a signature in
    /// `agreed`, so both are emptied together.
    prepared: Mutex<HashMap<u64, Vec<Prepared>>>,
    /// The operations' symmetric scratch buffers by [`Scratch`], grown
    /// collectively on demand. They refer back to this group, so
    /// [`Group::release_scratch`] breaks the cycle when the caller gives the
    /// group up.
    scratch: [Mutex<Option<Arc<Handle>>>; Scratch::COUNT],
    /// Every live rendezvoused handle of this group, by the address range
    /// of this rank's data.
    symmetric: Mutex<Vec<(std::ops::Range<u64>, Weak<Handle>)>>,
}

/// A workload cycling through more distinct calls than this re-agrees
/// after each wrap-around; memory stays bounded.
const MAX_AGREED: usize = 1024;

/// A call the operations layer prepared (see [`Group::prepared`]).
pub type Prepared = Arc<dyn std::any::Any + Send + Sync>;

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
        let check_args_always = cfg.resolved_check_args_always();
        let local = timeout
            .and_then(|_| check_args_always.clone())
            .and_then(|_| cfg.resolved_backend())
            .and_then(|choice| backend::select(choice, device));
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(|e| err!(System, "getrandom: {e}"))?;
        let payload = match &local {
            Ok(b) => Ok(encode_rank_info(
                &RankInfo { host: host_identity(), pid: std::process::id(), device: b.device(), backend: b.kind() },
                &secret,
            )),
            Err(e) => Err(e.clone()),
        };
        let all = exchange(bootstrap.as_ref(), payload, wait)?;
        let backend = local?;
        let mut ranks = Vec::with_capacity(world);
        let mut rank0_secret = [0u8; 32];
        for (r, bytes) in all.iter().enumerate() {
            let (info, s) = decode_rank_info(bytes)?;
            if r == 0 {
                rank0_secret = s;
            }
            ranks.push(info);
        }
        check_ranks(&ranks, rank, cfg.allow_shared_device)?;
        Ok(Arc::new(Group {
            rank,
            world,
            timeout_ms: AtomicU64::new(wait.as_millis() as u64),
            backend,
            bootstrap,
            collective: Mutex::new(()),
            secret: rank0_secret,
            ranks,
            check_args_always: check_args_always?,
            agreed: Mutex::default(),
            prepared: Mutex::default(),
            scratch: Default::default(),
            symmetric: Mutex::new(Vec::new()),
        }))
    }

    /// Forms one group per entry of `devices` in this process (rank i on
    /// `devices[i]`), each on its own thread so that they can meet.
    pub fn new_local(devices: &[i32], cfg: &GroupConfig) -> Result<Vec<Arc<Group>>> {
        let bootstraps = crate::bootstrap::local::local_bootstraps(devices.len());
        std::thread::scope(|s| {
            let joins: Vec<_> = bootstraps
                .into_iter()
                .zip(devices)
                .map(|(bs, &dev)| s.spawn(move || Group::new(Box::new(bs), dev, cfg)))
                .collect();
            let results: Vec<Result<Arc<Group>>> = joins
                .into_iter()
                .map(|j| j.join().unwrap_or_else(|_| Err(err!(Internal, "panic while forming an in-process group"))))
                .collect();
            // Report the root cause, not a peer's echo of it.
            let first = results.iter().position(|r| matches!(r, Err(e) if e.kind != crate::ErrorKind::Remote));
            match first.or_else(|| results.iter().position(Result::is_err)) {
                Some(i) => Err(results.into_iter().nth(i).unwrap().unwrap_err()),
                None => Ok(results.into_iter().map(Result::unwrap).collect()),
            }
        })
    }

    /// Reports an asynchronous failure (a device-side signal timeout).
    pub fn check_async_error(&self) -> Result<()> {
        self.backend.check_async_error()
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

    /// Takes the collective lock for a multi-step collective.
    pub fn lock_collective(&self) -> MutexGuard<'_, ()> {
        lock(&self.collective)
    }

    /// Collective: every rank offers its own result; all get every rank's
    /// payload if all succeeded, else an error (this rank's own, or
    /// `Remote` naming the rank that failed and why). Call with the
    /// collective lock held.
    pub fn exchange(&self, local: Result<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        exchange(self.bootstrap.as_ref(), local, self.timeout())
    }

    /// Whether operations exchange their signature on every call.
    pub fn check_args_always(&self) -> bool {
        self.check_args_always
    }

    /// Whether every rank agreed on this signature before.
    pub fn is_agreed(&self, signature: &[u8]) -> bool {
        lock(&self.agreed).contains(signature)
    }

    /// Records a signature every rank just agreed on. Call on every rank,
    /// right after the exchange that showed the agreement.
    pub fn mark_agreed(&self, signature: Vec<u8>) {
        let mut agreed = lock(&self.agreed);
        if agreed.len() >= MAX_AGREED {
            agreed.clear();
            // A prepared call skips the agreement as its signature is agreed.
            lock(&self.prepared).clear();
        }
        agreed.insert(signature);
    }

    /// The calls prepared under `hash` (see [`Group::keep_prepared`]).
    pub fn prepared(&self, hash: u64) -> Vec<Prepared> {
        lock(&self.prepared).get(&hash).cloned().unwrap_or_default()
    }

    /// Keeps a call the operations layer prepared, checked and agreed on
    /// (its signature is in the agreed set now), under a hash of its
    /// arguments, for identical calls to reuse.
    pub fn keep_prepared(&self, hash: u64, call: Prepared) {
        let mut prepared = lock(&self.prepared);
        if prepared.len() >= MAX_AGREED {
            prepared.clear();
        }
        prepared.entry(hash).or_default().push(call);
    }

    /// The operations' scratch buffer of `kind`, if one was made.
    pub fn scratch(&self, kind: Scratch) -> Option<Arc<Handle>> {
        lock(&self.scratch[kind as usize]).clone()
    }

    /// The operations' workspace, if one was made.
    pub fn workspace(&self) -> Option<Arc<Handle>> {
        self.scratch(Scratch::Workspace)
    }

    /// Replaces a scratch buffer (the old one is freed once no call uses it).
    pub fn set_scratch(&self, kind: Scratch, h: Arc<Handle>) {
        *lock(&self.scratch[kind as usize]) = Some(h);
    }

    /// Frees the scratch buffers, which otherwise keep the group alive
    /// through their buffers' references, once the work issued so far has
    /// finished (it may still use them). Called when the caller destroys
    /// the group. They are freed even if waiting fails: the device is then
    /// broken, and its next call says so.
    pub fn release_scratch(&self) {
        if self.scratch.iter().any(|s| lock(s).is_some()) {
            let _ = self.backend.quiesce(None);
        }
        self.scratch.iter().for_each(|s| drop(lock(s).take()));
    }

    /// Adds a rendezvoused handle to the registry that
    /// [`Group::find_symmetric`] searches.
    pub fn register_symmetric(&self, h: &Arc<Handle>) {
        let start = h.buffer().addr();
        let mut reg = lock(&self.symmetric);
        reg.retain(|(_, w)| w.strong_count() > 0);
        reg.push((start..start + h.buffer().size() as u64, Arc::downgrade(h)));
    }

    /// A live rendezvoused handle whose data on this rank holds all of
    /// `range`.
    pub fn find_symmetric(&self, range: std::ops::Range<u64>) -> Option<Arc<Handle>> {
        let reg = lock(&self.symmetric);
        reg.iter().filter(|(r, _)| r.start <= range.start && range.end <= r.end).find_map(|(_, w)| w.upgrade())
    }

    /// Collective barrier over the bootstrap (not the data path).
    pub fn bootstrap_barrier(&self) -> Result<()> {
        let _g = self.lock_collective();
        self.bootstrap.barrier(self.timeout())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded values stay consistent even if a holder panicked.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// See [`Group::exchange`].
fn exchange(bs: &dyn Bootstrap, local: Result<Vec<u8>>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
    let msg = match &local {
        Ok(p) => Writer::new().u8(0).bytes(p).finish(),
        Err(e) => Writer::new().u8(1).str(&e.msg).finish(),
    };
    let all = allgather_var(bs, &msg, timeout)?;
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

fn encode_rank_info(m: &RankInfo, secret: &[u8; 32]) -> Vec<u8> {
    Writer::new().str(&m.host).u32(m.pid).u32(m.device as u32).str(m.backend.name()).bytes(secret).finish()
}

fn decode_rank_info(b: &[u8]) -> Result<(RankInfo, [u8; 32])> {
    let mut r = Reader::new(b, "group announcement");
    let host = r.str()?;
    let pid = r.u32()?;
    let device = r.u32()? as i32;
    let backend = match r.str()?.as_str() {
        "cuda" => BackendKind::Cuda,
        _ => BackendKind::Host,
    };
    let secret: [u8; 32] = r.bytes()?.try_into().map_err(|_| err!(Internal, "malformed group secret"))?;
    Ok((RankInfo { host, pid, device, backend }, secret))
}

/// Every rank must use the same backend; CUDA ranks must not share a device
/// (unless allowed) and must be on one host, since peers are mapped by IPC.
fn check_ranks(ranks: &[RankInfo], me: usize, allow_shared_device: bool) -> Result<()> {
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
        if info.host != mine.host {
            return Err(err!(
                Unsupported,
                "rank {r} runs on host {:?} and rank {me} on {:?}; symmetric memory needs every rank on one host",
                info.host,
                mine.host
            ));
        }
    }
    if mine.backend == BackendKind::Cuda && !allow_shared_device {
        for (a, x) in ranks.iter().enumerate() {
            for (b, y) in ranks.iter().enumerate().skip(a + 1) {
                if x.device == y.device {
                    return Err(err!(Mismatch, "ranks {a} and {b} both use CUDA device {}; give each rank its own device or allow shared devices in the group config", x.device));
                }
            }
        }
    }
    Ok(())
}

/// Identifies this host (and boot), so ranks can tell whether IPC reaches.
fn host_identity() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    format!("{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::local::local_bootstraps;
    use crate::ErrorKind;

    fn host_cfg() -> GroupConfig {
        GroupConfig { backend: Some(BackendChoice::Host), timeout: Some(Duration::from_secs(5)), ..Default::default() }
    }

    /// Prepared calls stand for agreed signatures: when the agreed set
    /// wraps around, they are forgotten with it.
    #[test]
    fn prepared_calls_are_forgotten_with_the_agreed_signatures() {
        let g = Group::new_local(&[0], &host_cfg()).unwrap().pop().unwrap();
        g.keep_prepared(7, Arc::new(1u8));
        g.keep_prepared(7, Arc::new(2u8));
        assert_eq!(g.prepared(7).len(), 2);
        assert!(g.prepared(8).is_empty());
        for i in 0..MAX_AGREED {
            g.mark_agreed(i.to_le_bytes().to_vec());
        }
        assert_eq!(g.prepared(7).len(), 2, "the agreed set has not wrapped yet");
        g.mark_agreed(b"one more".to_vec());
        assert!(g.prepared(7).is_empty());
        assert!(g.is_agreed(b"one more") && !g.is_agreed(&0usize.to_le_bytes()));
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
        let info = |d| RankInfo { host: "h".into(), pid: 1, device: d, backend: BackendKind::Cuda };
        let ranks = vec![info(0), info(0)];
        assert_eq!(check_ranks(&ranks, 0, false).unwrap_err().kind, ErrorKind::Mismatch);
        assert!(check_ranks(&ranks, 0, true).is_ok());
    }
}
