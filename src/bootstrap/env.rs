//! Bootstrap from a torchrun-style environment.
//!
//! `RANK` and `WORLD_SIZE` are required, `LOCAL_RANK` optional (defaults to
//! `RANK`). Rank 0 hosts symm's TCP store and every rank connects to it at
//! `MASTER_ADDR` (default `127.0.0.1`) on port `SYMM_BOOTSTRAP_PORT`, or
//! `MASTER_PORT + 1` when that is not set: torchrun's own store already
//! listens on `MASTER_PORT`. Set `SYMM_BOOTSTRAP_PORT` when `MASTER_PORT + 1`
//! is taken by something else on rank 0's host.
//!
//! Rank 0 binds `MASTER_ADDR` itself when it is a loopback address given
//! literally (`127.0.0.1`, `::1`, `localhost`), so single-host jobs expose
//! nothing; otherwise it binds every interface, as torchrun's store does,
//! because a host name can resolve to a loopback alias (127.0.1.1) on the
//! host that owns it while other hosts reach it by its real address.
//!
//! The group's secret is `SYMM_BOOTSTRAP_SECRET` (hashed to 32 bytes) when
//! set. Otherwise it is derived from `MASTER_ADDR`, `MASTER_PORT`,
//! `WORLD_SIZE`, `TORCHELASTIC_RUN_ID` and `TORCHELASTIC_RESTART_COUNT`:
//! that keeps jobs and restarts sharing a host from joining each other's
//! groups by accident, but anyone who can read the job's environment can
//! compute it, so it is no defence against an attacker. Set
//! `SYMM_BOOTSTRAP_SECRET` to a random value on untrusted networks.
//!
//! Each call of [`connect_env`] in a process forms a new group with its own
//! secret (a per-process call counter is mixed in), so every rank must call
//! it the same number of times, as with any collective.

use super::tcp::{host_store, resolve, TcpBootstrap};
use super::unique_id::{UniqueId, SECRET_BYTES};
use crate::error::{ensure, err, Result};
use crate::wire::Writer;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Default store host when `MASTER_ADDR` is not set.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// Where this process sits in the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvInfo {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
}

/// Where the env store lives and the group's secret.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// `MASTER_ADDR` as given (host name or IP).
    pub host: String,
    pub port: u16,
    pub secret: [u8; SECRET_BYTES],
}

/// Shows where the store is; the secret stays out of logs.
impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreConfig({}:{})", self.host, self.port)
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

/// Works out the store's host, port and secret through `lookup`;
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
    Ok(StoreConfig { host, port, secret: env_secret(lookup, generation) })
}

/// Number of env groups this process has formed (see the module docs).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Forms a group from the environment: rank 0 hosts the store, then every
/// rank connects, waiting up to `timeout` for the store to come up.
pub fn connect_env(timeout: Duration) -> Result<(TcpBootstrap, EnvInfo)> {
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    connect_env_from(&process_env, generation, timeout)
}

/// [`connect_env`] reading variables through `lookup`, as the
/// `generation`-th env group of this process.
pub fn connect_env_from(lookup: Lookup, generation: u64, timeout: Duration) -> Result<(TcpBootstrap, EnvInfo)> {
    let info = read_env_from(lookup)?;
    let cfg = store_config_from(lookup, generation)?;
    let store = resolve(&cfg.host, cfg.port).map_err(|e| e.context("MASTER_ADDR"))?;
    if info.rank == 0 {
        host_store(bind_addr(&cfg.host, store), cfg.secret)?;
    }
    let id = UniqueId::new(store, cfg.secret);
    let bs = TcpBootstrap::connect(&id, info.rank, info.world, timeout)?;
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

/// The group's secret: the user's, or one derived from what every rank of
/// this job (and no other job) sees alike.
fn env_secret(lookup: Lookup, generation: u64) -> [u8; SECRET_BYTES] {
    let parts: Vec<String> = match get(lookup, crate::config::BOOTSTRAP_SECRET) {
        Some(s) => vec!["user".into(), s],
        None => {
            let keys =
                ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"];
            let mut v = vec!["derived".to_string()];
            v.extend(keys.iter().map(|k| get(lookup, k).unwrap_or_default()));
            v
        }
    };
    let mut m = Writer::new().raw(b"symm-env-secret-v1");
    for p in &parts {
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

    #[test]
    fn store_port_and_host() {
        let c = store_config_from(&env(&[("MASTER_PORT", "29500")]), 0).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 29501));
        let vars = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500"), ("SYMM_BOOTSTRAP_PORT", "7000")];
        let c = store_config_from(&env(&vars), 0).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("node0", 7000));
        assert_eq!(format!("{c:?}"), "StoreConfig(node0:7000)");
        let c = store_config_from(&env(&[("SYMM_BOOTSTRAP_PORT", "7000")]), 0).unwrap();
        assert_eq!(c.port, 7000);

        let e = store_config_from(&env(&[]), 0).unwrap_err();
        assert!(e.msg.contains("MASTER_PORT is not set"), "{e}");
        let e = store_config_from(&env(&[("MASTER_PORT", "65535")]), 0).unwrap_err();
        assert!(e.msg.contains("SYMM_BOOTSTRAP_PORT"), "{e}");
        let e = store_config_from(&env(&[("MASTER_PORT", "70000")]), 0).unwrap_err();
        assert!(e.msg.contains("MASTER_PORT='70000'"), "{e}");
    }

    #[test]
    fn secrets_separate_jobs_and_generations() {
        let base = [("MASTER_ADDR", "n0"), ("MASTER_PORT", "29500"), ("WORLD_SIZE", "4"), ("RANK", "0")];
        let secret = |extra: &[(&str, &str)], g| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            store_config_from(&env(&v), g).unwrap().secret
        };
        let s = secret(&[], 0);
        // Every rank derives the same secret; RANK does not enter it.
        assert_eq!(s, secret(&[("RANK", "3")], 0));
        assert_ne!(s, secret(&[], 1));
        assert_ne!(s, secret(&[("TORCHELASTIC_RUN_ID", "job7")], 0));
        assert_ne!(s, secret(&[("TORCHELASTIC_RESTART_COUNT", "1")], 0));
        let user = secret(&[("SYMM_BOOTSTRAP_SECRET", "hunter2")], 0);
        assert_ne!(s, user);
        assert_eq!(user, secret(&[("SYMM_BOOTSTRAP_SECRET", "hunter2"), ("MASTER_PORT", "1")], 0));
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
        let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "no-such-host.invalid"), ("MASTER_PORT", "9")];
        let e = connect_env_from(&env(&vars), 0, Duration::from_millis(100)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.msg.starts_with("MASTER_ADDR: ") && e.msg.contains("no-such-host.invalid"), "{e}");
    }

    /// Rank 0 hosts, the others connect (before the store is up), each
    /// with its own private environment.
    #[test]
    fn env_group_forms() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let world = 3;
        let hs: Vec<_> = (0..world)
            .rev()
            .map(|rank| {
                thread::spawn(move || {
                    let p = port.to_string();
                    let w = world.to_string();
                    let r = rank.to_string();
                    let vars = [("RANK", r.as_str()), ("WORLD_SIZE", w.as_str()), ("SYMM_BOOTSTRAP_PORT", p.as_str())];
                    let look = env(&vars);
                    if rank == 0 {
                        // The others start first and wait for the store.
                        thread::sleep(Duration::from_millis(50));
                    }
                    let (bs, info) = connect_env_from(&look, 0, Duration::from_secs(10)).unwrap();
                    assert_eq!((info.rank, info.world, info.local_rank), (rank, world, rank));
                    bs.allgather(&[rank as u8], Duration::from_secs(10)).unwrap()
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), vec![0, 1, 2]);
        }
    }
}
