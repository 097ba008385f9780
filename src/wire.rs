//! The one little-endian encoding symm uses for what crosses a process
//! boundary: the metadata ranks exchange through the bootstrap, the TCP
//! store's messages and the fd server's requests. Records are small and
//! versioned by their callers, so a serialization framework would be more
//! than the job needs.
//!
//! `bytes`/`str` are length-prefixed (`u32`); `raw` is not (fixed-size
//! fields, magics, or a payload that runs to the end of the record).

use crate::error::{err, Result};

#[derive(Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self = self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    pub fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }
    /// `v` as is, with no length prefix.
    pub fn raw(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
    /// Zeros up to `len` bytes in all (no-op if already that long).
    pub fn pad_to(mut self, len: usize) -> Self {
        if self.0.len() < len {
            self.0.resize(len, 0);
        }
        self
    }
    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// `what` names the record in errors ("rendezvous metadata").
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(err!(Bootstrap, "truncated {} from a peer", self.what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
    /// The next `n` bytes (no length prefix).
    pub fn raw(&mut self, n: usize) -> Result<&'a [u8]> {
        self.take(n)
    }
    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().unwrap())
    }
    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let b = Writer::new().u8(7).u16(513).u32(9).u64(u64::MAX).str("hé").bytes(&[1, 2]).raw(b"xy").finish();
        let mut r = Reader::new(&b, "test");
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u16().unwrap(), 513);
        assert_eq!(r.u32().unwrap(), 9);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.str().unwrap(), "hé");
        assert_eq!(r.bytes().unwrap(), &[1, 2]);
        assert_eq!(&r.array::<2>().unwrap(), b"xy");
        assert!(r.is_empty());
        assert!(r.u8().is_err());
    }

    #[test]
    fn raw_rest_and_padding() {
        let b = Writer::new().raw(b"abc").pad_to(6).u8(9).finish();
        assert_eq!(b, [b'a', b'b', b'c', 0, 0, 0, 9]);
        let mut r = Reader::new(&b, "test");
        assert_eq!(r.raw(2).unwrap(), b"ab");
        assert_eq!(r.raw(4).unwrap(), [b'c', 0, 0, 0]);
        assert_eq!(r.rest(), &[9]);
        assert!(r.is_empty() && r.rest().is_empty());
        let e = Reader::new(&b, "test").raw(8).unwrap_err();
        assert_eq!((e.kind, e.msg.as_str()), (crate::error::ErrorKind::Bootstrap, "truncated test from a peer"));
    }
}
