//! The 128-byte unique id that lets ranks find a group's TCP store.
//!
//! One rank creates it (`symm_get_unique_id`), ships it to the others by its
//! own means (MPI broadcast, a file, a Python object...), and every rank
//! passes it to group init. It carries the store's socket address and a
//! random 32-byte secret that the store demands before it serves anyone, so a
//! stray process (or a stale id from an earlier run) cannot join the group.
//!
//! Layout (all integers little-endian; bytes not listed are zero):
//!
//! | bytes   | content                                         |
//! |---------|-------------------------------------------------|
//! | 0..6    | magic `SYMMID`                                  |
//! | 6       | format version ([`VERSION`])                    |
//! | 7       | address family: 4 or 6                          |
//! | 8..10   | port                                            |
//! | 10..26  | IP address (IPv4 uses the first 4 bytes)        |
//! | 26..30  | IPv6 scope id (link-local addresses need it)    |
//! | 32..64  | secret                                          |

use crate::error::{ensure, err, Result};
use crate::wire::{Reader, Writer};
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// Size of the id, fixed by the C ABI (`symm_unique_id_t`).
pub const ID_BYTES: usize = 128;
/// Size of the secret the store checks.
pub const SECRET_BYTES: usize = 32;
/// Bumped whenever the layout changes, so ids from another build are refused
/// with a clear message instead of being misread.
pub const VERSION: u8 = 1;

const MAGIC: &[u8; 6] = b"SYMMID";
const OFF_VERSION: usize = 6;
const OFF_FAMILY: usize = 7;
const OFF_PORT: usize = 8;
const OFF_SECRET: usize = 32;

/// A group's unique id. The bytes are public so the FFI layer can copy them
/// in and out of `symm_unique_id_t`; read them back through [`UniqueId::decode`]
/// (or [`UniqueId::validate`]) before trusting them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; ID_BYTES]);

impl UniqueId {
    /// Encodes the store's address and the group's secret.
    pub fn new(addr: SocketAddr, secret: [u8; SECRET_BYTES]) -> Self {
        let (family, ip, scope) = match addr {
            SocketAddr::V4(a) => {
                let mut ip = [0u8; 16];
                ip[..4].copy_from_slice(&a.ip().octets());
                (4, ip, 0)
            }
            SocketAddr::V6(a) => (6, a.ip().octets(), a.scope_id()),
        };
        let b = Writer::new()
            .raw(MAGIC)
            .u8(VERSION)
            .u8(family)
            .u16(addr.port())
            .raw(&ip)
            .u32(scope)
            .pad_to(OFF_SECRET)
            .raw(&secret)
            .pad_to(ID_BYTES)
            .finish();
        UniqueId(b.try_into().expect("the layout fills exactly ID_BYTES"))
    }

    /// Reads an id from untrusted bytes (exactly [`ID_BYTES`] long), checking
    /// magic, version and address family.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        ensure!(bytes.len() == ID_BYTES, InvalidArgument, "unique id must be {ID_BYTES} bytes, got {}", bytes.len());
        let id = UniqueId(bytes.try_into().expect("length checked above"));
        id.validate()?;
        Ok(id)
    }

    /// Checks that the bytes are an id this build understands.
    pub fn validate(&self) -> Result<()> {
        let b = &self.0;
        ensure!(
            &b[..MAGIC.len()] == MAGIC,
            InvalidArgument,
            "not a symm unique id (bad magic): was it produced by symm_get_unique_id \
             and copied whole?"
        );
        ensure!(
            b[OFF_VERSION] == VERSION,
            InvalidArgument,
            "unique id has format version {} but this build of symm reads version {VERSION}: \
             all ranks must use the same symm release",
            b[OFF_VERSION]
        );
        ensure!(
            matches!(b[OFF_FAMILY], 4 | 6),
            InvalidArgument,
            "unique id is corrupt: unknown address family {}",
            b[OFF_FAMILY]
        );
        Ok(())
    }

    /// The store's address.
    pub fn addr(&self) -> Result<SocketAddr> {
        self.validate()?;
        let mut r = Reader::new(&self.0[OFF_PORT..], "unique id");
        let (port, ip, scope) = (r.u16()?, r.array::<16>()?, r.u32()?);
        Ok(match self.0[OFF_FAMILY] {
            4 => {
                let v4: [u8; 4] = ip[..4].try_into().unwrap();
                SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(v4), port))
            }
            _ => SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope)),
        })
    }

    /// The secret the store demands from every connection.
    pub fn secret(&self) -> [u8; SECRET_BYTES] {
        self.0[OFF_SECRET..OFF_SECRET + SECRET_BYTES].try_into().unwrap()
    }
}

/// Shows the address only: ids end up in logs, the secret must not.
impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr() {
            Ok(a) => write!(f, "UniqueId({a})"),
            Err(_) => write!(f, "UniqueId(<invalid>)"),
        }
    }
}

/// A fresh secret from the OS's CSPRNG.
pub fn random_secret() -> Result<[u8; SECRET_BYTES]> {
    let mut s = [0u8; SECRET_BYTES];
    getrandom::fill(&mut s).map_err(|e| err!(System, "getrandom failed: {e}"))?;
    Ok(s)
}

/// Compares two secrets in time independent of where they differ, so a peer
/// probing the store cannot learn a secret byte by byte from reply timing.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box keeps the optimizer from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn secret(x: u8) -> [u8; 32] {
        let mut s = [0u8; 32];
        for (i, b) in s.iter_mut().enumerate() {
            *b = x.wrapping_add(i as u8);
        }
        s
    }

    #[test]
    fn roundtrip_v4() {
        let a: SocketAddr = "10.1.2.3:29500".parse().unwrap();
        let id = UniqueId::new(a, secret(7));
        let back = UniqueId::decode(&id.0).unwrap();
        assert_eq!(back.addr().unwrap(), a);
        assert_eq!(back.secret(), secret(7));
        assert_eq!(&id.0[..6], b"SYMMID");
    }

    /// The bytes sit where the layout table (and the C ABI) says.
    #[test]
    fn layout_matches_the_table() {
        let v4 = UniqueId::new("10.1.2.3:258".parse().unwrap(), [0xaa; 32]).0;
        let mut want = [0u8; ID_BYTES];
        want[..6].copy_from_slice(b"SYMMID");
        want[6..10].copy_from_slice(&[VERSION, 4, 2, 1]);
        want[10..14].copy_from_slice(&[10, 1, 2, 3]);
        want[32..64].copy_from_slice(&[0xaa; 32]);
        assert_eq!(v4, want);
        let a = SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 1, 0, 0x0102_0304));
        let v6 = UniqueId::new(a, [0xbb; 32]).0;
        assert_eq!(v6[7], 6);
        assert_eq!(v6[10..26], "fe80::1".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(v6[26..32], [4, 3, 2, 1, 0, 0]);
        assert!(v6[64..].iter().all(|&x| x == 0));
    }

    #[test]
    fn roundtrip_v6_with_scope() {
        let a = SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 65535, 0, 3));
        let id = UniqueId::new(a, secret(200));
        let back = UniqueId::decode(&id.0).unwrap();
        assert_eq!(back.addr().unwrap(), a);
        assert_eq!(back.secret(), secret(200));
    }

    #[test]
    fn rejects_bad_magic() {
        let mut b = UniqueId::new("127.0.0.1:1".parse().unwrap(), secret(1)).0;
        b[0] = b'X';
        let e = UniqueId::decode(&b).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.msg.contains("magic"), "{}", e.msg);
        assert!(UniqueId::decode(&[0u8; 128]).is_err());
    }

    #[test]
    fn rejects_other_version_and_family() {
        let mut b = UniqueId::new("127.0.0.1:1".parse().unwrap(), secret(1)).0;
        b[6] = VERSION + 1;
        let e = UniqueId::decode(&b).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.msg.contains("version"), "{}", e.msg);
        b[6] = VERSION;
        b[7] = 5;
        assert_eq!(UniqueId::decode(&b).unwrap_err().kind, ErrorKind::InvalidArgument);
        assert!(UniqueId(b).addr().is_err());
    }

    #[test]
    fn rejects_wrong_length() {
        let e = UniqueId::decode(&[0u8; 64]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
    }

    #[test]
    fn debug_hides_secret() {
        let id = UniqueId::new("127.0.0.1:5".parse().unwrap(), [0xab; 32]);
        let s = format!("{id:?}");
        assert_eq!(s, "UniqueId(127.0.0.1:5)");
    }

    #[test]
    fn secrets_are_random_and_compare() {
        let a = random_secret().unwrap();
        let b = random_secret().unwrap();
        assert_ne!(a, b);
        assert!(ct_eq(&a, &a));
        assert!(!ct_eq(&a, &b));
        assert!(!ct_eq(&a, &a[..31]));
    }
}
