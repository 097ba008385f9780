//! End to end: stores and clients of this process talking over loopback.

use super::addr::advertised;
use super::client::{reply_wait, LINGER};
use super::server::{open_rounds, Limits, Server};
use super::stream::Target;
use super::wire::*;
use super::*;
use crate::bootstrap::on_ranks;
use crate::bootstrap::Bootstrap;
use crate::error::ErrorKind;
use crate::sync::lock;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(300);

fn connect_all(id: &UniqueId, world: usize) -> Vec<TcpBootstrap> {
    (0..world).map(|r| TcpBootstrap::connect(id, r, world, T).unwrap()).collect()
}

#[test]
fn unspecified_listen_advertises_a_dialable_address() {
    let a = advertised("0.0.0.0:1234".parse().unwrap());
    assert!(!a.ip().is_unspecified());
    assert!(a.is_ipv4());
    assert_eq!(a.port(), 1234);
    let id = create_unique_id(Some("0.0.0.0")).unwrap();
    let ip = id.addr().unwrap().ip();
    assert!(!ip.is_unspecified());
    let bs = connect_all(&id, 1);
    assert_eq!(bs[0].allgather(b"q", T).unwrap(), b"q");
}

#[test]
fn allgather_one_to_four_ranks() {
    for world in 1..=4 {
        let id = create_unique_id(None).unwrap();
        let out = on_ranks(connect_all(&id, world), |b| {
            let mut last = Vec::new();
            for i in 0..5u8 {
                last = b.allgather(&[b.rank() as u8, i], T).unwrap();
            }
            b.allgather(&[0], T).unwrap();
            last
        });
        let want: Vec<u8> = (0..world as u8).flat_map(|r| [r, 4]).collect();
        assert!(out.iter().all(|o| *o == want));
        assert_eq!(open_rounds(&id), 0);
    }
}

#[test]
fn ids_share_one_store_but_not_rounds() {
    let a = create_unique_id(Some("127.0.0.1:0")).unwrap();
    let b = create_unique_id(Some("127.0.0.1")).unwrap();
    assert_eq!(a.addr().unwrap(), b.addr().unwrap());
    assert_ne!(a.secret(), b.secret());
    let ga = connect_all(&a, 2);
    let gb = connect_all(&b, 2);
    let mut all = Vec::new();
    for (i, c) in ga.into_iter().chain(gb).enumerate() {
        all.push(thread::spawn(move || c.allgather(&[i as u8], T).unwrap()));
    }
    let out: Vec<_> = all.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(out, [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]);
}

#[test]
fn many_rounds_leave_nothing_behind() {
    let id = create_unique_id(None).unwrap();
    on_ranks(connect_all(&id, 2), |b| {
        for i in 0..10_000u32 {
            let all = b.allgather(&i.to_le_bytes(), T).unwrap();
            assert_eq!(&all[4..], &i.to_le_bytes());
        }
    });
    assert_eq!(open_rounds(&id), 0);
}

#[test]
fn timeout_names_missing_ranks() {
    let id = create_unique_id(None).unwrap();
    let bs = connect_all(&id, 4);
    let out = on_ranks(bs, |b| (b.rank() < 2).then(|| b.allgather(&[1], SHORT).unwrap_err()));
    for e in out.into_iter().flatten() {
        assert_eq!(e.kind, ErrorKind::Timeout);
        assert_eq!(e.msg, "bootstrap: ranks [2, 3] of 4 did not arrive within 300 ms");
    }
}

/// Peers of the hosting rank get the round's own error even when the
/// host returns at once: its bootstrap holds on until their replies
/// are written (a process exit right after would otherwise cut them off).
#[test]
fn hosting_rank_lets_owed_replies_out_before_it_returns() {
    let id = create_unique_id(None).unwrap();
    let peer = TcpBootstrap::connect(&id, 1, 3, T).unwrap();
    let host = TcpBootstrap::connect(&id, 0, 3, T).unwrap();
    let ns = host.hosted.clone().expect("this process hosts the store");
    *lock(&ns.slow_replies_to) = Some(1);
    let waiting = thread::spawn(move || peer.allgather(&[1], T).unwrap_err());
    while *lock(&ns.in_flight) == 0 {
        thread::sleep(Duration::from_millis(1));
    }
    let e = host.allgather(&[0], SHORT).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Timeout);
    drop(host);
    assert_eq!(*lock(&ns.in_flight), 0, "a reply to the peer was still unwritten");
    let e = waiting.join().unwrap();
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    assert!(e.msg.contains("rank 2 of 3"), "{e}");
}

/// A peer waiting on a round the host never joins delays the host's
/// goodbye by at most `LINGER`.
#[test]
fn hosting_rank_lingers_for_a_bounded_time() {
    let id = create_unique_id(None).unwrap();
    let peer = TcpBootstrap::connect(&id, 1, 2, T).unwrap();
    let host = TcpBootstrap::connect(&id, 0, 2, T).unwrap();
    let ns = host.hosted.clone().unwrap();
    let wait = LINGER + Duration::from_secs(1);
    let waiting = thread::spawn(move || peer.allgather(&[1], wait).unwrap_err());
    while *lock(&ns.in_flight) == 0 {
        thread::sleep(Duration::from_millis(1));
    }
    let t = Instant::now();
    drop(host);
    let held = t.elapsed();
    assert!(held >= LINGER - Duration::from_millis(50) && held < wait, "held {held:?}");
    assert_eq!(waiting.join().unwrap().kind, ErrorKind::Timeout);
}

#[test]
fn wrong_secret_is_refused() {
    let id = create_unique_id(None).unwrap();
    let forged = UniqueId::new(id.addr().unwrap(), [0x5a; 32]);
    let e = TcpBootstrap::connect(&forged, 0, 1, T).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Bootstrap);
    assert!(e.msg.contains("wrong secret"), "{e}");
}

#[test]
fn duplicate_rank_fails_the_group() {
    let id = create_unique_id(None).unwrap();
    let r0 = TcpBootstrap::connect(&id, 0, 3, T).unwrap();
    let r1 = TcpBootstrap::connect(&id, 1, 3, T).unwrap();
    let waiting = thread::spawn(move || r0.allgather(&[0], T));
    let e = TcpBootstrap::connect(&id, 1, 3, T).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Mismatch);
    assert!(e.msg.contains("rank 1 was claimed by two processes"), "{e}");
    // Both legitimate-looking ranks hear about it instead of hanging.
    assert_eq!(waiting.join().unwrap().unwrap_err(), e);
    assert_eq!(r1.allgather(&[1], T).unwrap_err(), e);
}

/// A rank whose connection closes without a goodbye (its process ended)
/// fails the rounds that need it at once, a timeout naming it, while a
/// round it finished before is served as usual.
#[test]
fn a_rank_gone_without_a_goodbye_fails_the_rounds_that_need_it_at_once() {
    let id = create_unique_id(None).unwrap();
    let mut bs = connect_all(&id, 3);
    let r2 = bs.pop().unwrap();
    let r1 = bs.pop().unwrap();
    let r0 = bs.pop().unwrap();
    let done = thread::spawn(move || (r1.allgather(&[1], T).unwrap(), r1));
    let h2 = thread::spawn(move || (r2.allgather(&[2], T).unwrap(), r2));
    assert_eq!(r0.allgather(&[0], T).unwrap(), [0, 1, 2]);
    let ((_, r1), (_, r2)) = (done.join().unwrap(), h2.join().unwrap());
    r1.vanish();
    let t = Instant::now();
    let h2 = thread::spawn(move || r2.allgather(&[2], T).unwrap_err());
    let e0 = r0.allgather(&[0], T).unwrap_err();
    let e2 = h2.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    for e in [e0, e2] {
        assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
        assert!(e.msg.contains("rank 1 of 3 closed its connection to the store without a goodbye"), "{e}");
    }
}

/// Once every rank has joined, a process reusing the unique id for one of
/// its ranks is refused alone: the group it would disturb goes on.
#[test]
fn a_stray_claim_on_a_formed_group_is_refused_alone() {
    let id = create_unique_id(None).unwrap();
    let bs = connect_all(&id, 2);
    let e = TcpBootstrap::connect(&id, 0, 2, T).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Mismatch);
    assert!(e.msg.contains("taken by a formed group"), "{e}");
    let out = on_ranks(bs, |b| b.allgather(&[b.rank() as u8], T).unwrap());
    assert!(out.iter().all(|o| *o == [0, 1]), "{out:?}");
}

/// A rank that leaves frees its rank for a successor while the group
/// lives; once every rank has joined and left, the id is spent.
#[test]
fn rank_is_released_on_drop_and_a_finished_group_is_forgotten() {
    let id = create_unique_id(None).unwrap();
    let r0 = TcpBootstrap::connect(&id, 0, 2, T).unwrap();
    let r1 = TcpBootstrap::connect(&id, 1, 2, T).unwrap();
    let h = thread::spawn(move || r1.allgather(&[1], T).unwrap());
    assert_eq!(r0.allgather(&[0], T).unwrap(), [0, 1]);
    assert_eq!(h.join().unwrap(), [0, 1]);
    for _ in 0..3 {
        drop(TcpBootstrap::connect(&id, 1, 2, T).unwrap());
    }
    drop(r0);
    let e = TcpBootstrap::connect(&id, 0, 2, T).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Bootstrap);
    assert!(e.msg.contains("a group that has finished"), "{e}");
}

#[test]
fn world_and_length_mismatch_reported_to_all() {
    let id = create_unique_id(None).unwrap();
    let a = TcpBootstrap::connect(&id, 0, 2, T).unwrap();
    let b = TcpBootstrap::connect(&id, 1, 3, T).unwrap();
    let ha = thread::spawn(move || a.allgather(&[0], T));
    let eb = b.allgather(&[1], T).unwrap_err();
    let ea = ha.join().unwrap().unwrap_err();
    assert_eq!(eb.kind, ErrorKind::Mismatch);
    assert!(eb.msg.contains("world size"), "{eb}");
    assert_eq!(ea, eb);

    let id = create_unique_id(None).unwrap();
    let out = on_ranks(connect_all(&id, 3), |b| b.allgather(&vec![0; 1 + b.rank() / 2], T));
    for r in out {
        let e = r.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Mismatch);
        assert!(e.msg.contains("bytes"), "{e}");
    }
}

#[test]
fn unreachable_store_is_a_bootstrap_error() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let id = UniqueId::new(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port), [1; 32]);
    let t = Instant::now();
    let e = TcpBootstrap::connect(&id, 0, 2, SHORT).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Bootstrap);
    assert!(e.msg.contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(t.elapsed() >= SHORT && t.elapsed() < SHORT * 5);
}

#[test]
fn late_store_is_waited_for() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port);
    let secret = random_secret().unwrap();
    let id = UniqueId::new(listen, secret);
    let client = thread::spawn(move || TcpBootstrap::connect(&id, 0, 1, T));
    thread::sleep(Duration::from_millis(100));
    let hosted = host_store(listen, secret).unwrap();
    assert_eq!(hosted.addr().unwrap(), listen);
    let c = client.join().unwrap().unwrap();
    assert_eq!(c.allgather(b"hi", T).unwrap(), b"hi");
}

#[test]
fn host_store_bind_failure_names_address() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let e = host_store(addr, [2; 32]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Bootstrap);
    assert!(e.msg.contains(&addr.to_string()), "{e}");
}

/// A store that accepts the hello and then never answers, or hangs up.
fn fake_store(hang_up: bool) -> UniqueId {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        read_frame(&mut s, HELLO_CAP).unwrap();
        Reply::Ok(&[]).write_to(&mut s).unwrap();
        let _ = read_frame(&mut s, FRAME_CAP);
        if !hang_up {
            thread::sleep(Duration::from_secs(5));
        }
    });
    UniqueId::new(addr, [3; 32])
}

#[test]
fn dead_store_never_hangs_a_caller() {
    for hang_up in [true, false] {
        let c = TcpBootstrap::connect(&fake_store(hang_up), 0, 2, T).unwrap();
        assert!(c.hosted.is_none());
        let t = Instant::now();
        let e = c.allgather(&[1], SHORT).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap, "{e}");
        assert!(t.elapsed() < reply_wait(SHORT) + Duration::from_millis(500));
        let e2 = c.allgather(&[1], SHORT).unwrap_err();
        assert!(e2.msg.contains("lost earlier"), "{e2}");
    }
}

#[test]
fn garbage_is_refused_without_allocating() {
    let id = create_unique_id(None).unwrap();
    let mut s = TcpStream::connect(id.addr().unwrap()).unwrap();
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let body = read_frame(&mut s, 1 << 16).unwrap();
    let e = Reply::decode(&body).unwrap().into_result().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Bootstrap);
    assert!(e.msg.contains("exceeds"), "{e}");
    // ...and the store hangs up.
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn validates_rank_and_world() {
    let id = create_unique_id(None).unwrap();
    for (r, w) in [(2, 2), (0, 0)] {
        let e = TcpBootstrap::connect(&id, r, w, T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
    }
    let bad = UniqueId([0; 128]);
    assert_eq!(TcpBootstrap::connect(&bad, 0, 1, T).unwrap_err().kind, ErrorKind::InvalidArgument);
}

/// A private store (other tests share the process's default one).
fn private_store(limits: Limits) -> (Arc<Server>, [u8; 32]) {
    let secret = random_secret().unwrap();
    let listen = Target::Tcp("127.0.0.1:0".parse().unwrap());
    (Server::start(&listen, secret, limits, None).unwrap(), secret)
}

/// Raises this process's fd limit to at least `n` (within the hard limit).
fn allow_fds(n: u64) {
    // SAFETY: plain get/setrlimit on a local struct.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        if l.rlim_cur < n {
            l.rlim_cur = n.min(l.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// Whether the peer has closed `s` (EOF or reset), without waiting long.
fn closed_by_peer(s: &TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    let mut b = [0u8; 256];
    loop {
        match (&*s).read(&mut b) {
            Ok(0) => return true,
            // The store's parting error message.
            Ok(_) => continue,
            Err(e) => return !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }
}

/// 1,000 strangers that announce a hello and then drip it a byte at a time
/// neither stop real ranks from joining nor pile up: at most `max_pending`
/// of them wait at once (each new one drops the oldest), and the dripping
/// buys none of them time past the handshake deadline.
#[test]
fn dripping_strangers_neither_block_ranks_nor_pile_up() {
    allow_fds(4096);
    let limits = Limits { handshake: Duration::from_millis(1500), ..Limits::DEFAULT };
    let (server, secret) = private_store(limits);
    let addr = server.tcp_addr();
    let start = Instant::now();
    let strangers: Vec<TcpStream> = (0..1000)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&100u32.to_le_bytes()).unwrap();
            s
        })
        .collect();
    let strangers = Arc::new(strangers);
    let drip = {
        let strangers = strangers.clone();
        thread::spawn(move || {
            let until = Instant::now() + limits.handshake * 2;
            while Instant::now() < until {
                for mut s in strangers.iter() {
                    let _ = s.write(&[1]);
                }
                thread::sleep(Duration::from_millis(100));
            }
        })
    };
    thread::sleep(Duration::from_millis(200));
    assert!(server.pending() <= limits.max_pending, "{} pending", server.pending());
    let threads = server.handshakes.load(std::sync::atomic::Ordering::SeqCst);
    assert!(threads <= limits.max_pending + 8, "{threads} handshake threads");
    // Real ranks join and exchange at once, while the dripping goes on.
    let id = UniqueId::new(addr, secret);
    let t = Instant::now();
    let out = on_ranks(connect_all(&id, 2), |b| b.allgather(&[b.rank() as u8], T).unwrap());
    assert_eq!(out, [vec![0, 1], vec![0, 1]]);
    assert!(t.elapsed() < Duration::from_secs(1), "joining took {:?}", t.elapsed());
    drip.join().unwrap();
    // Past the deadline every stranger is gone, dripping or not.
    assert!(start.elapsed() > limits.handshake);
    let deadline = Instant::now() + Duration::from_secs(2);
    while (server.pending() > 0 || server.handshakes.load(std::sync::atomic::Ordering::SeqCst) > 0)
        && Instant::now() < deadline
    {
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.pending(), 0);
    assert_eq!(server.handshakes.load(std::sync::atomic::Ordering::SeqCst), 0);
    let open = strangers.iter().filter(|s| !closed_by_peer(s)).count();
    assert_eq!(open, 0, "{open} strangers still connected");
}

/// A process that makes groups all its life keeps a flat store: 100,000
/// ids, each used by a group that then ends, leave nothing behind; ids
/// made and never used are capped.
#[test]
fn a_store_making_groups_for_a_lifetime_stays_flat() {
    const IDS: u64 = 100_000;
    // Groups come and go on several threads at once, as in a server.
    const THREADS: u64 = 8;
    let (server, _) = private_store(Limits::DEFAULT);
    let addr = server.tcp_addr();
    let base = server.namespaces();
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let server = server.clone();
            thread::spawn(move || {
                let mut secret = random_secret().unwrap();
                for i in (t..IDS).step_by(THREADS as usize) {
                    secret[..8].copy_from_slice(&i.to_le_bytes());
                    server.register(secret);
                    let b = TcpBootstrap::connect(&UniqueId::new(addr, secret), 0, 1, T).unwrap();
                    assert_eq!(b.allgather(&i.to_le_bytes(), T).unwrap(), i.to_le_bytes());
                    drop(b);
                    let held = server.namespaces();
                    assert!(held <= base + THREADS as usize, "{held} namespaces after group {i}");
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(server.namespaces(), base);
    let mut secret = random_secret().unwrap();
    for i in 0..IDS {
        secret[..8].copy_from_slice(&i.to_le_bytes());
        server.register(secret);
    }
    assert_eq!(server.namespaces(), Limits::DEFAULT.max_idle);
    // The newest unused ids still work.
    let b = TcpBootstrap::connect(&UniqueId::new(addr, secret), 0, 1, T).unwrap();
    assert_eq!(b.allgather(b"x", T).unwrap(), b"x");
}
