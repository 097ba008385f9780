//! Bootstrap from a torchrun-style environment.
//!
//! `RANK` and `WORLD_SIZE` are required, `LOCAL_RANK` optional (defaults to
//! `RANK`). How the ranks meet depends on where they are:
//!
//! - **All on this host** (`LOCAL_WORLD_SIZE` equals `WORLD_SIZE`, as
//!   torchrun sets it on a single node; or, without `LOCAL_WORLD_SIZE`, a
//!   loopback `MASTER_ADDR`): rank 0 serves the group on an abstract Unix
//!   socket whose name every rank derives from the job's parameters, and
//!   admits only processes of this user (`SO_PEERCRED` on both ends; a
//!   process of this user could read our memory anyway). Nothing listens on
//!   the network, and no secret is needed.
//! - **Across hosts**: rank 0 hosts symm's TCP store and every rank connects
//!   to it at `MASTER_ADDR` (default `127.0.0.1`) on port
//!   `SYMM_BOOTSTRAP_PORT`, or `MASTER_PORT + 1` when that is not set
//!   (torchrun's own store already listens on `MASTER_PORT`). The store
//!   admits only ranks presenting the group's secret, made from
//!   `SYMM_BOOTSTRAP_SECRET`, which must be set: everything else a launcher
//!   exports (`MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`, ...) is
//!   on command lines or easy to guess, so a stranger who reached the port
//!   could compute a secret made from it.
//!
//! Rank 0 binds `MASTER_ADDR` itself when it is a loopback address given
//! literally (`127.0.0.1`, `::1`, `localhost`), so single-host jobs expose
//! nothing; otherwise it binds every interface, as torchrun's store does,
//! because a host name can resolve to a loopback alias (127.0.1.1) on the
//! host that owns it while other hosts reach it by its real address.
//!
//! Each call of [`connect_env`] in a process forms a new group, the
//! `generation`-th (a per-process call counter), so every rank must call it
//! the same number of times, as with any collective. The generation is part
//! of the socket name and of the secret: a rank that arrives before rank 0
//! finds nothing (or only an earlier group) and waits until rank 0 opens
//! the new group or its timeout ends.

use super::tcp::{host_store, join_store, join_unix, resolve, TcpBootstrap};
use super::unique_id::SECRET_BYTES;
use crate::error::{ensure, err, Result};
use crate::wire::Writer;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Default store host when `MASTER_ADDR` is not set.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// Shortest `SYMM_BOOTSTRAP_SECRET` accepted: a floor against obvious
/// mistakes (it cannot measure randomness).
pub const MIN_SECRET_LEN: usize = 16;

/// Where this process sits in the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvInfo {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
}

/// Where the ranks meet and the group's key there.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// `MASTER_ADDR` as given (host name or IP).
    pub host: String,
    pub port: u16,
    /// All ranks are on this host: they meet on an abstract Unix socket.
    pub same_host: bool,
    /// Across hosts, the secret the store demands (from
    /// `SYMM_BOOTSTRAP_SECRET`); on one host, a key derived from the job's
    /// parameters that names the socket (not secret: uids admit there).
    pub secret: [u8; SECRET_BYTES],
}

/// Shows where the store is; the secret stays out of logs.
impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = if self.same_host { "this host" } else { "network" };
        write!(f, "StoreConfig({}:{}, {how})", self.host, self.port)
    }
}

/// Looks an environment variable up; empty values count as unset.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn process_env(key: &str) -> Option<String> {
    crate::config::launcher_var(key)
}

/// Reads the rank variables through `lookup` (testable without touching the
/// process environment).
pub fn read_env_from(lookup: Lookup) -> Result<EnvInfo> {
    let hint = "(launch with torchrun, or set RANK and WORLD_SIZE)";
    let rank: usize = required(lookup, "RANK", hint)?;
    let world: usize = required(lookup, "WORLD_SIZE", hint)?;
    ensure!(world >= 1, InvalidArgument, "environment variable WORLD_SIZE must be at least 1");
    ensure!(rank < world, InvalidArgument, "environment variable RANK={rank} is out of range for WORLD_SIZE={world}");
    let local_rank = optional(lookup, "LOCAL_RANK")?.unwrap_or(rank);
    ensure!(
        local_rank < world,
        InvalidArgument,
        "environment variable LOCAL_RANK={local_rank} is out of range for WORLD_SIZE={world}"
    );
    Ok(EnvInfo { rank, world, local_rank })
}

/// Works out where the ranks meet and the group's key through `lookup`;
/// `generation` is the number of env groups this process formed before.
pub fn store_config_from(lookup: Lookup, generation: u64) -> Result<StoreConfig> {
    let host = get(lookup, "MASTER_ADDR").unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string());
    let port = match optional::<u16>(lookup, crate::config::BOOTSTRAP_PORT)? {
        Some(p) => p,
        None => {
            let hint = "(or set SYMM_BOOTSTRAP_PORT)";
            let mp: u16 = required(lookup, "MASTER_PORT", hint)?;
            mp.checked_add(1).ok_or_else(|| {
                err!(
                    InvalidArgument,
                    "MASTER_PORT={mp} leaves no port for symm's store at MASTER_PORT + 1: \
                     set SYMM_BOOTSTRAP_PORT"
                )
            })?
        }
    };
    ensure!(port != 0, InvalidArgument, "symm's bootstrap port must not be 0");
    let same_host = same_host(lookup, &host)?;
    let secret = if same_host { local_key(lookup, port, generation) } else { network_secret(lookup, generation)? };
    Ok(StoreConfig { host, port, same_host, secret })
}

/// Whether every rank runs on this host (see the module docs).
fn same_host(lookup: Lookup, host: &str) -> Result<bool> {
    match optional::<usize>(lookup, "LOCAL_WORLD_SIZE")? {
        Some(local) => Ok(optional::<usize>(lookup, "WORLD_SIZE")? == Some(local)),
        None => Ok(host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())),
    }
}

/// Number of env groups this process has formed (see the module docs).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Forms a group from the environment: rank 0 hosts the meeting point,
/// then every rank joins, waiting up to `timeout` for it to open.
pub fn connect_env(timeout: Duration) -> Result<(TcpBootstrap, EnvInfo)> {
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    connect_env_from(&process_env, generation, timeout)
}

/// [`connect_env`] reading variables through `lookup`, as the
/// `generation`-th env group of this process.
pub fn connect_env_from(lookup: Lookup, generation: u64, timeout: Duration) -> Result<(TcpBootstrap, EnvInfo)> {
    let info = read_env_from(lookup)?;
    let cfg = store_config_from(lookup, generation)?;
    let (rank, world) = (info.rank, info.world);
    let bs = if cfg.same_host {
        let name = socket_name(&cfg.secret);
        join_unix(&name, cfg.secret, rank, world, rank == 0, timeout).map_err(|e| {
            if rank == 0 && e.msg.contains("cannot listen") {
                e.context(
                    "another process of this host holds the group's socket (a job with the same \
                     MASTER_ADDR, MASTER_PORT and WORLD_SIZE?)",
                )
            } else {
                e
            }
        })?
    } else {
        let store = resolve(&cfg.host, cfg.port).map_err(|e| e.context("MASTER_ADDR"))?;
        if rank == 0 {
            host_store(bind_addr(&cfg.host, store), cfg.secret)?;
        }
        join_store(store, cfg.secret, rank, world, timeout)?
    };
    Ok((bs, info))
}

/// What rank 0 listens on (see the module docs for why).
fn bind_addr(host: &str, store: SocketAddr) -> SocketAddr {
    let literal = host.parse::<IpAddr>().is_ok() || host.eq_ignore_ascii_case("localhost");
    if store.ip().is_loopback() && literal {
        return store;
    }
    let any = match store.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    SocketAddr::new(any, store.port())
}

/// The secret of a group spanning hosts: `SYMM_BOOTSTRAP_SECRET`, required.
fn network_secret(lookup: Lookup, generation: u64) -> Result<[u8; SECRET_BYTES]> {
    let var = crate::config::BOOTSTRAP_SECRET;
    let Some(user) = get(lookup, var) else {
        return Err(err!(
            InvalidArgument,
            "environment variable {var} is not set: ranks on several hosts meet at a network store, \
             which admits only ranks that present a secret no stranger can guess (nothing torchrun \
             exports is one). Set {var} to the same random value on every rank, e.g. \
             `export {var}=$(openssl rand -hex 16)` before launching (or, when every rank runs on this \
             host, set LOCAL_WORLD_SIZE to WORLD_SIZE)"
        ));
    };
    ensure!(
        user.len() >= MIN_SECRET_LEN,
        InvalidArgument,
        "environment variable {var} is {} characters long; use a random value of at least \
         {MIN_SECRET_LEN} (e.g. `openssl rand -hex 16`)",
        user.len()
    );
    Ok(digest(b"symm-env-secret-v2", &[user.as_str()], generation))
}

/// The key of a group on one host: the same on every rank of this job and
/// generation, different for other jobs and restarts sharing the host.
fn local_key(lookup: Lookup, port: u16, generation: u64) -> [u8; SECRET_BYTES] {
    let keys = ["MASTER_ADDR", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"];
    let mut parts: Vec<String> = keys.iter().map(|k| get(lookup, k).unwrap_or_default()).collect();
    parts.push(port.to_string());
    parts.push(get(lookup, crate::config::BOOTSTRAP_SECRET).unwrap_or_default());
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    digest(b"symm-env-local-v1", &parts, generation)
}

/// The abstract socket name for a same-host group's key; the uid keeps
/// users' jobs apart.
fn socket_name(key: &[u8; SECRET_BYTES]) -> Vec<u8> {
    let h = sha256(&Writer::new().raw(b"symm-env-socket").raw(key).finish());
    let hex: String = h[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("symm-env-{}-{hex}", crate::ipc::euid()).into_bytes()
}

fn digest(domain: &[u8], parts: &[&str], generation: u64) -> [u8; SECRET_BYTES] {
    let mut m = Writer::new().raw(domain);
    for p in parts {
        // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        m = m.u64(p.len() as u64).raw(p.as_bytes());
    }
    sha256(&m.u64(generation).finish())
}

fn get(lookup: Lookup, key: &str) -> Option<String> {
    lookup(key).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

fn optional<T: FromStr>(lookup: Lookup, key: &str) -> Result<Option<T>> {
    let Some(v) = get(lookup, key) else { return Ok(None) };
    v.parse()
        .map(Some)
        .map_err(|_| err!(InvalidArgument, "environment variable {key}='{v}' is not a valid non-negative integer"))
}

fn required<T: FromStr>(lookup: Lookup, key: &str, hint: &str) -> Result<T> {
    optional(lookup, key)?.ok_or_else(|| err!(InvalidArgument, "environment variable {key} is not set {hint}"))
}

/// SHA-256 (FIPS 180-4), enough to turn secrets of any length into the 32
/// bytes the store checks, the same on every rank and every build.
fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
        0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
        0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
        0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
        0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
        0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
        0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] =
        [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes(word.try_into().unwrap());
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let [a, b, c, d, e, f, g, hh] = v;
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[i]).wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            v = [t1.wrapping_add(t2), a, b, c, d.wrapping_add(t1), e, f, g];
        }
        for (x, y) in h.iter_mut().zip(v) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    for (o, x) in out.chunks_exact_mut(4).zip(h) {
        o.copy_from_slice(&x.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::Bootstrap;
    use crate::error::ErrorKind;
    use std::collections::HashMap;
    use std::thread;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn sha256_vectors() {
        assert_eq!(hex(&sha256(b"")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(hex(&sha256(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(hex(&sha256(&[b'a'; 1000])), "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3");
    }

    #[test]
    fn reads_ranks() {
        let info = read_env_from(&env(&[("RANK", "2"), ("WORLD_SIZE", " 4 "), ("LOCAL_RANK", "0")])).unwrap();
        assert_eq!(info, EnvInfo { rank: 2, world: 4, local_rank: 0 });
        let info = read_env_from(&env(&[("RANK", "3"), ("WORLD_SIZE", "4")])).unwrap();
        assert_eq!(info.local_rank, 3);
    }

    #[test]
    fn names_the_bad_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("WORLD_SIZE", "4")], "RANK is not set"),
            (&[("RANK", "0")], "WORLD_SIZE is not set"),
            (&[("RANK", ""), ("WORLD_SIZE", "2")], "RANK is not set"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK='x'"),
            (&[("RANK", "-1"), ("WORLD_SIZE", "2")], "RANK='-1'"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK=2 is out of range"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE must be"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "a")], "LOCAL_RANK='a'"),
        ];
        for (vars, want) in cases {
            let e = read_env_from(&env(vars)).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
            assert!(e.msg.contains(want), "{} does not mention {want}", e.msg);
        }
    }

    const SECRET: &str = "0123456789abcdef0123";

    #[test]
    fn store_port_and_host() {
        let c = store_config_from(&env(&[("MASTER_PORT", "29500")]), 0).unwrap();
        assert_eq!((c.host.as_str(), c.port, c.same_host), ("127.0.0.1", 29501, true));
        let vars = [
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("SYMM_BOOTSTRAP_PORT", "7000"),
            ("SYMM_BOOTSTRAP_SECRET", SECRET),
        ];
        let c = store_config_from(&env(&vars), 0).unwrap();
        assert_eq!((c.host.as_str(), c.port, c.same_host), ("node0", 7000, false));
        assert_eq!(format!("{c:?}"), "StoreConfig(node0:7000, network)");
        let c = store_config_from(&env(&[("SYMM_BOOTSTRAP_PORT", "7000")]), 0).unwrap();
        assert_eq!(c.port, 7000);

        let e = store_config_from(&env(&[]), 0).unwrap_err();
        assert!(e.msg.contains("MASTER_PORT is not set"), "{e}");
        let e = store_config_from(&env(&[("MASTER_PORT", "65535")]), 0).unwrap_err();
        assert!(e.msg.contains("SYMM_BOOTSTRAP_PORT"), "{e}");
        let e = store_config_from(&env(&[("MASTER_PORT", "70000")]), 0).unwrap_err();
        assert!(e.msg.contains("MASTER_PORT='70000'"), "{e}");
    }

    /// All ranks on this host when torchrun says so (LOCAL_WORLD_SIZE ==
    /// WORLD_SIZE) or, without it, when MASTER_ADDR is loopback.
    #[test]
    fn where_ranks_meet() {
        let same = |vars: &[(&str, &str)]| {
            let mut v = vec![("MASTER_PORT", "29500"), ("SYMM_BOOTSTRAP_SECRET", SECRET)];
            v.extend_from_slice(vars);
            store_config_from(&env(&v), 0).unwrap().same_host
        };
        assert!(same(&[]));
        assert!(same(&[("MASTER_ADDR", "localhost")]));
        assert!(same(&[("MASTER_ADDR", "::1")]));
        assert!(!same(&[("MASTER_ADDR", "node0")]));
        assert!(!same(&[("MASTER_ADDR", "10.0.0.1")]));
        assert!(same(&[("MASTER_ADDR", "node0"), ("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "8")]));
        assert!(!same(&[("MASTER_ADDR", "127.0.0.1"), ("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "4")]));
        let e = store_config_from(&env(&[("MASTER_PORT", "1"), ("LOCAL_WORLD_SIZE", "x")]), 0).unwrap_err();
        assert!(e.msg.contains("LOCAL_WORLD_SIZE='x'"), "{e}");
    }

    /// Across hosts there is no default secret: one derived from what the
    /// launcher exports would admit anyone who knows the launch command.
    #[test]
    fn network_store_requires_a_secret() {
        let base = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500"), ("WORLD_SIZE", "4"), ("RANK", "1")];
        let with = |extra: &[(&str, &str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            store_config_from(&env(&v), 0)
        };
        for extra in [&[][..], &[("TORCHELASTIC_RUN_ID", "job7")][..], &[("SYMM_BOOTSTRAP_SECRET", " ")][..]] {
            let e = with(extra).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
            assert!(e.msg.contains("SYMM_BOOTSTRAP_SECRET is not set"), "{e}");
        }
        let e = with(&[("SYMM_BOOTSTRAP_SECRET", "hunter2")]).unwrap_err();
        assert!(e.msg.contains("SYMM_BOOTSTRAP_SECRET is 7 characters long"), "{e}");
        // The same secret on every rank; generations and secrets apart.
        let s = with(&[("SYMM_BOOTSTRAP_SECRET", SECRET)]).unwrap().secret;
        assert_eq!(s, with(&[("SYMM_BOOTSTRAP_SECRET", SECRET), ("RANK", "3")]).unwrap().secret);
        assert_ne!(s, with(&[("SYMM_BOOTSTRAP_SECRET", "0123456789abcdef0124")]).unwrap().secret);
        let mut v = base.to_vec();
        v.push(("SYMM_BOOTSTRAP_SECRET", SECRET));
        assert_ne!(s, store_config_from(&env(&v), 1).unwrap().secret);
        // The failure reaches the caller of connect as well, before any
        // socket is opened.
        let e = connect_env_from(&env(&base), 0, Duration::from_millis(100)).unwrap_err();
        assert!(e.msg.contains("SYMM_BOOTSTRAP_SECRET"), "{e}");
    }

    #[test]
    fn local_keys_separate_jobs_and_generations() {
        let base = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("WORLD_SIZE", "4"), ("RANK", "0")];
        let key = |extra: &[(&str, &str)], g| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            store_config_from(&env(&v), g).unwrap().secret
        };
        let k = key(&[], 0);
        // Every rank derives the same key; RANK does not enter it.
        assert_eq!(k, key(&[("RANK", "3")], 0));
        assert_ne!(k, key(&[], 1));
        assert_ne!(k, key(&[("TORCHELASTIC_RUN_ID", "job7")], 0));
        assert_ne!(k, key(&[("TORCHELASTIC_RESTART_COUNT", "1")], 0));
        assert_ne!(k, key(&[("MASTER_PORT", "29502")], 0));
        assert_ne!(socket_name(&k), socket_name(&key(&[], 1)));
        assert!(socket_name(&k).starts_with(format!("symm-env-{}-", crate::ipc::euid()).as_bytes()));
    }

    #[test]
    fn bind_address_choice() {
        let lo: SocketAddr = "127.0.0.1:5".parse().unwrap();
        assert_eq!(bind_addr("127.0.0.1", lo), lo);
        assert_eq!(bind_addr("localhost", lo), lo);
        // A host name that resolves to a loopback alias on its own host.
        assert_eq!(bind_addr("node0", "127.0.1.1:5".parse().unwrap()), "0.0.0.0:5".parse().unwrap());
        assert_eq!(bind_addr("10.0.0.2", "10.0.0.2:5".parse().unwrap()), "0.0.0.0:5".parse().unwrap());
        assert_eq!(bind_addr("fd00::2", "[fd00::2]:5".parse().unwrap()), "[::]:5".parse().unwrap());
    }

    #[test]
    fn connect_reports_bad_master_addr() {
        let vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "no-such-host.invalid"),
            ("MASTER_PORT", "9"),
            ("SYMM_BOOTSTRAP_SECRET", SECRET),
        ];
        let e = connect_env_from(&env(&vars), 0, Duration::from_millis(100)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.msg.starts_with("MASTER_ADDR: ") && e.msg.contains("no-such-host.invalid"), "{e}");
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// The variables of `rank` in a job of `world` on `port`: all on this
    /// host, or (`network`) as if spread over hosts, with a secret.
    fn job(port: u16, world: usize, rank: usize, network: bool) -> impl Fn(&str) -> Option<String> {
        let mut v = vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("SYMM_BOOTSTRAP_PORT", port.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
        ];
        if network {
            v.push(("LOCAL_WORLD_SIZE", "1".into()));
            v.push(("SYMM_BOOTSTRAP_SECRET", SECRET.into()));
        }
        let m: HashMap<String, String> = v.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        move |k| m.get(k).cloned()
    }

    /// Rank 0 hosts, the others join (before it is up), each with its own
    /// private environment, on one host and across "hosts".
    #[test]
    fn env_group_forms() {
        for network in [false, true] {
            let port = free_port();
            let world = 3;
            let hs: Vec<_> = (0..world)
                .rev()
                .map(|rank| {
                    thread::spawn(move || {
                        if rank == 0 {
                            // The others start first and wait for the store.
                            thread::sleep(Duration::from_millis(50));
                        }
                        let (bs, info) = connect_env_from(&job(port, world, rank, network), 0, T).unwrap();
                        assert_eq!((info.rank, info.world, info.local_rank), (rank, world, rank));
                        bs.allgather(&[rank as u8], T).unwrap()
                    })
                })
                .collect();
            for h in hs {
                assert_eq!(h.join().unwrap(), vec![0, 1, 2]);
            }
            // On one host nothing listens on the network.
            if !network {
                assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
            }
        }
    }

    const T: Duration = Duration::from_secs(10);

    /// A stranger who knows every launch parameter (and so the secret the
    /// store used to derive from them) is refused by the network store and
    /// learns nothing of rank 0's record.
    #[test]
    fn stranger_with_the_launch_parameters_is_refused() {
        let port = free_port();
        let look = job(port, 2, 0, true);
        let host = thread::spawn(move || {
            let (bs, _) = connect_env_from(&look, 0, T).unwrap();
            bs.allgather(b"rank 0's record", Duration::from_millis(500))
        });
        let public = ["127.0.0.1", &(port - 1).to_string(), "2", "", ""];
        let mut guesses = vec![digest(b"symm-env-secret-v1", &public, 0), [0u8; 32]];
        guesses.push(local_key(&job(port, 2, 1, true), port, 0));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        for guess in guesses {
            let id = crate::bootstrap::unique_id::UniqueId::new(addr, guess);
            let e = TcpBootstrap::connect(&id, 1, 2, T).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Bootstrap);
            assert!(e.msg.contains("wrong secret"), "{e}");
        }
        // Rank 0 heard from nobody.
        let e = host.join().unwrap().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
        assert!(e.msg.contains("rank 1 of 2 did not arrive"), "{e}");
    }

    /// On one host the socket admits only this user: a process of another
    /// uid is cut off before it can say anything (checked where the tests
    /// run as root and can switch uid in a child).
    #[test]
    fn same_host_socket_refuses_other_users() {
        if crate::ipc::euid() != 0 {
            eprintln!("skipped: needs root to start a process of another uid");
            return;
        }
        let port = free_port();
        let look = job(port, 2, 0, false);
        let name = socket_name(&store_config_from(&look, 0).unwrap().secret);
        let host = thread::spawn(move || {
            let (bs, _) = connect_env_from(&look, 0, T).unwrap();
            bs.allgather(&[0], Duration::from_millis(1500))
        });
        // Prepared before fork: the child only makes system calls.
        let (addr, len) = abstract_sockaddr(&name);
        let mut hello = Vec::new();
        let secret = [0u8; 32];
        crate::bootstrap::tcp::wire::Request::Hello { protocol: 2, secret, rank: 1, world: 2 }
            .write_to(&mut hello)
            .unwrap();
        thread::sleep(Duration::from_millis(200));
        // SAFETY: the child calls only async-signal-safe functions on
        // memory prepared before the fork, then _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            unsafe {
                if libc::setuid(65534) != 0 {
                    libc::_exit(3);
                }
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                if libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) != 0 {
                    libc::_exit(4);
                }
                libc::send(fd, hello.as_ptr().cast(), hello.len(), libc::MSG_NOSIGNAL);
                let mut buf = [0u8; 64];
                let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
                libc::_exit(if n <= 0 { 0 } else { 1 });
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "the other user's process got an answer (or could not connect)");
        let e = host.join().unwrap().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    }

    fn abstract_sockaddr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
        // SAFETY: all-zero is a valid sockaddr_un.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, &c) in addr.sun_path[1..].iter_mut().zip(name) {
            *d = c as libc::c_char;
        }
        let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
        (addr, len as libc::socklen_t)
    }

    /// A rank whose rank 0 never comes gets a timeout naming rank 0, on
    /// either path, within about its timeout.
    #[test]
    fn missing_rank_0_is_a_timeout() {
        for network in [false, true] {
            let t = std::time::Instant::now();
            let e = connect_env_from(&job(free_port(), 2, 1, network), 0, Duration::from_millis(300)).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
            assert!(e.msg.contains("rank 0 did not open"), "{e}");
            assert!(t.elapsed() < Duration::from_secs(3));
        }
    }

    /// Groups made one after another from one environment form every time,
    /// whoever arrives first: a rank ahead of rank 0 finds only the previous
    /// group (or nothing) and waits for the new one instead of failing.
    #[test]
    fn env_groups_in_a_row_form_in_any_arrival_order() {
        const GROUPS: u64 = 300;
        for network in [false, true] {
            let port = free_port();
            let world = 3;
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    thread::spawn(move || {
                        let look = job(port, world, rank, network);
                        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ ((rank as u64 + 1) * 0x1234_5678);
                        for g in 0..GROUPS {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            thread::sleep(Duration::from_micros(rng % 3000));
                            let (bs, _) = connect_env_from(&look, g, T)
                                .unwrap_or_else(|e| panic!("group {g} (network {network}), rank {rank}: {e}"));
                            let all = bs.allgather(&g.to_le_bytes(), T).unwrap();
                            assert_eq!(all, g.to_le_bytes().repeat(world));
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        }
    }
}
