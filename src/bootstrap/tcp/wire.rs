//! The store's protocol, in one place.
//!
//! Every message is a frame: `u32` body length, then the body. Integers are
//! little-endian (encoded with [`crate::wire`]). Bodies start with a tag byte:
//!
//! | message | body                                                               |
//! |---------|--------------------------------------------------------------------|
//! | Hello   | 1, protocol `u32`, secret `[u8; 32]`, rank `u32`, world `u32`      |
//! | Gather  | 2, seq `u64`, rank `u32`, world `u32`, timeout_ms `u64`, payload   |
//! | Bye     | 3                                                                  |
//! | Ok      | 0, data (Hello/Bye: empty; Gather: all payloads in rank order)     |
//! | Err     | 1, error kind `u8`, UTF-8 message                                  |
//! | Refused | 2, UTF-8 message (Hello: no group with this secret here, yet)      |
//!
//! The client sends Hello first and waits for Ok; then any number of Gather
//! (each answered by Ok or Err), then optionally Bye. Refused is kept apart
//! from Err because a client whose group's host is late may try again.

use crate::error::{err, Error, ErrorKind, Result};
use crate::wire::{Reader, Writer};
use std::io::{self, BufWriter, Read, Write};

/// Largest frame anyone sends or accepts.
pub const FRAME_CAP: usize = 1 << 30;
/// Largest frame accepted before the peer has proven it knows the secret,
/// so garbage cannot make the store allocate more than this.
pub const HELLO_CAP: usize = 1024;
/// Bumped on any incompatible change to the messages.
pub const PROTOCOL: u32 = 2;

const TAG_HELLO: u8 = 1;
const TAG_GATHER: u8 = 2;
const TAG_BYE: u8 = 3;
const TAG_OK: u8 = 0;
const TAG_ERR: u8 = 1;
const TAG_REFUSED: u8 = 2;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Hello { protocol: u32, secret: [u8; 32], rank: u32, world: u32 },
    Gather { seq: u64, rank: u32, world: u32, timeout_ms: u64, payload: &'a [u8] },
    Bye,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply<'a> {
    Ok(&'a [u8]),
    Err(ErrorKind, &'a str),
    Refused(&'a str),
}

/// Error kinds by wire code; the position in this table is the code.
const KINDS: [ErrorKind; 12] = [
    ErrorKind::InvalidArgument,
    ErrorKind::InvalidHandle,
    ErrorKind::Unsupported,
    ErrorKind::Timeout,
    ErrorKind::Bootstrap,
    ErrorKind::Mismatch,
    ErrorKind::OutOfMemory,
    ErrorKind::Cuda,
    ErrorKind::NoDevice,
    ErrorKind::System,
    ErrorKind::Remote,
    ErrorKind::Internal,
];

fn kind_code(k: ErrorKind) -> u8 {
    KINDS.iter().position(|&x| x == k).unwrap_or(4) as u8
}

fn kind_from_code(c: u8) -> ErrorKind {
    KINDS.get(c as usize).copied().unwrap_or(ErrorKind::Bootstrap)
}

impl Request<'_> {
    /// Writes the request as one frame (the payload is not copied).
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        match self {
            Request::Hello { protocol, secret, rank, world } => {
                let b = Writer::new().u8(TAG_HELLO).u32(*protocol).raw(secret).u32(*rank).u32(*world).finish();
                write_frame(w, &[&b])
            }
            Request::Gather { seq, rank, world, timeout_ms, payload } => {
                let h = Writer::new().u8(TAG_GATHER).u64(*seq).u32(*rank).u32(*world).u64(*timeout_ms).finish();
                write_frame(w, &[&h, payload])
            }
            Request::Bye => write_frame(w, &[&[TAG_BYE]]),
        }
    }
}

impl<'a> Request<'a> {
    pub fn decode(body: &'a [u8]) -> Result<Self> {
        let mut r = Reader::new(body, "store message");
        let tag = r.u8().map_err(|_| truncated())?;
        let req = Self::fields(tag, &mut r)
            .map_err(|_| truncated())?
            .ok_or_else(|| malformed(&format!("unknown request tag {tag}")))?;
        if !r.is_empty() {
            return Err(malformed("trailing bytes"));
        }
        Ok(req)
    }

    /// The fields after `tag`; `None` for an unknown tag.
    fn fields(tag: u8, r: &mut Reader<'a>) -> Result<Option<Self>> {
        Ok(Some(match tag {
            TAG_HELLO => Request::Hello { protocol: r.u32()?, secret: r.array()?, rank: r.u32()?, world: r.u32()? },
            TAG_GATHER => Request::Gather {
                seq: r.u64()?,
                rank: r.u32()?,
                world: r.u32()?,
                timeout_ms: r.u64()?,
                payload: r.rest(),
            },
            TAG_BYE => Request::Bye,
            _ => return Ok(None),
        }))
    }
}

impl Reply<'_> {
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        match self {
            Reply::Ok(data) => write_frame(w, &[&[TAG_OK], data]),
            Reply::Err(kind, msg) => write_frame(w, &[&[TAG_ERR, kind_code(*kind)], msg.as_bytes()]),
            Reply::Refused(msg) => write_frame(w, &[&[TAG_REFUSED], msg.as_bytes()]),
        }
    }
}

impl<'a> Reply<'a> {
    pub fn decode(body: &'a [u8]) -> Result<Self> {
        let mut r = Reader::new(body, "store message");
        match r.u8().map_err(|_| truncated())? {
            TAG_OK => Ok(Reply::Ok(r.rest())),
            TAG_ERR => {
                let kind = kind_from_code(r.u8().map_err(|_| truncated())?);
                let msg = std::str::from_utf8(r.rest()).map_err(|_| malformed("error text is not UTF-8"))?;
                Ok(Reply::Err(kind, msg))
            }
            TAG_REFUSED => {
                let msg = std::str::from_utf8(r.rest()).map_err(|_| malformed("error text is not UTF-8"))?;
                Ok(Reply::Refused(msg))
            }
            t => Err(malformed(&format!("unknown reply tag {t}"))),
        }
    }

    /// The error a client reports for this reply, if it is one.
    pub fn into_result(self) -> Result<&'a [u8]> {
        match self {
            Reply::Ok(d) => Ok(d),
            Reply::Err(kind, msg) => Err(Error::new(kind, msg)),
            Reply::Refused(msg) => Err(Error::new(ErrorKind::Bootstrap, msg)),
        }
    }
}

/// Writes one frame made of `parts`, coalescing small writes.
pub fn write_frame(w: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len > FRAME_CAP {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("message of {len} bytes exceeds the {FRAME_CAP}-byte frame limit"),
        ));
    }
    let mut w = BufWriter::with_capacity(64 << 10, w);
    w.write_all(&Writer::new().u32(len as u32).finish())?;
    for p in parts {
        w.write_all(p)?;
    }
    w.flush()
}

/// Reads one frame of at most `cap` bytes. Memory grows with the bytes
/// that actually arrive, never with what the header claims.
pub fn read_frame(r: &mut impl Read, cap: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = Reader::new(&len, "frame header").u32().expect("4 bytes hold a u32") as usize;
    if len > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {cap}"),
        ));
    }
    let mut body = Vec::with_capacity(len.min(1 << 20));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(body)
}

fn malformed(what: &str) -> Error {
    err!(Bootstrap, "bootstrap: malformed store message: {what}")
}

fn truncated() -> Error {
    malformed("message is truncated")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_roundtrip() {
        let reqs = [
            Request::Hello { protocol: 1, secret: [9; 32], rank: 3, world: 4 },
            Request::Gather { seq: 1 << 40, rank: 2, world: 5, timeout_ms: 77, payload: b"xyz" },
            Request::Gather { seq: 0, rank: 0, world: 1, timeout_ms: 0, payload: b"" },
            Request::Bye,
        ];
        for r in &reqs {
            let mut buf = Vec::new();
            r.write_to(&mut buf).unwrap();
            let body = read_frame(&mut buf.as_slice(), FRAME_CAP).unwrap();
            assert_eq!(&Request::decode(&body).unwrap(), r);
        }
        let replies = [Reply::Ok(b"abc"), Reply::Err(ErrorKind::Timeout, "late"), Reply::Refused("who?")];
        for r in &replies {
            let mut buf = Vec::new();
            r.write_to(&mut buf).unwrap();
            let body = read_frame(&mut buf.as_slice(), FRAME_CAP).unwrap();
            assert_eq!(&Reply::decode(&body).unwrap(), r);
        }
        let e = Reply::Err(ErrorKind::Mismatch, "m").into_result().unwrap_err();
        assert_eq!((e.kind, e.msg.as_str()), (ErrorKind::Mismatch, "m"));
    }

    #[test]
    fn wire_rejects_garbage() {
        assert!(Request::decode(&[]).is_err());
        assert!(Request::decode(&[9]).is_err());
        assert!(Request::decode(&[1, 0, 0]).is_err());
        assert!(Request::decode(&[3, 0]).is_err());
        assert!(Reply::decode(&[1, 3, 0xff]).is_err());
        let e = Request::decode(&[2, 0]).unwrap_err();
        assert_eq!(
            (e.kind, e.msg.as_str()),
            (ErrorKind::Bootstrap, "bootstrap: malformed store message: message is truncated")
        );
        // Oversized and truncated frames.
        let big = (HELLO_CAP as u32 + 1).to_le_bytes();
        let e = read_frame(&mut big.as_slice(), HELLO_CAP).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let short = [5u8, 0, 0, 0, 1, 2];
        assert!(read_frame(&mut short.as_slice(), HELLO_CAP).is_err());
    }
}
