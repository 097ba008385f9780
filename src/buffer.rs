//! Symmetric buffers and their rendezvous.
//!
//! A [`Buffer`] is one rank's allocation: the data the caller asked for,
//! rounded to the backend's granularity, followed by a signal pad. A
//! [`Handle`] is the rendezvoused view: the allocations of every rank on this
//! host mapped here (a rank on another host is reached only through the
//! group's transports across hosts),
//! plus signalling over their pads.

use crate::backend::{pad_bytes, round_up, Allocation, CallTag, Mapping, PadSet, Signals, Stream};
use crate::error::{err, ErrorKind, Result};
use crate::group::{Attachment, Group, Purpose};
use crate::ipc;
use crate::sync::lock;
use crate::wire::{Reader, Writer};
use std::ops::Range;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, Weak};

pub struct Buffer {
    group: Arc<Group>,
    alloc: Box<dyn Allocation>,
    /// Bytes the caller asked for.
    size: usize,
    /// Offset of the signal pad (the rounded data size).
    pad_offset: usize,
}

impl Buffer {
    /// Allocates `size` bytes of symmetric memory on this rank (not collective).
    pub fn create(group: &Arc<Group>, size: usize) -> Result<Arc<Buffer>> {
        group.check_healthy()?;
        if size == 0 {
            return Err(err!(InvalidArgument, "size is 0: a symmetric buffer needs at least one byte"));
        }
        let gran = group.backend().granularity();
        let pad_offset =
            size.checked_next_multiple_of(gran).ok_or_else(|| err!(InvalidArgument, "size {size} is too large"))?;
        let total = pad_offset
            .checked_add(round_up(pad_bytes(group.world()), gran))
            .ok_or_else(|| err!(InvalidArgument, "size {size} is too large"))?;
        let alloc = group.backend().allocate(total)?;
        Ok(Arc::new(Buffer { group: group.clone(), alloc, size, pad_offset }))
    }

    /// Address of this rank's data.
    pub fn addr(&self) -> u64 {
        self.alloc.addr()
    }
    pub fn size(&self) -> usize {
        self.size
    }
    fn total(&self) -> usize {
        self.alloc.len()
    }
}

/// Every rank's copy of one buffer, mapped into this rank.
pub struct Handle {
    // Field order is drop order: signals reference the mappings' pads.
    signals: Box<dyn Signals>,
    /// Held, never read: the peers' memory stays mapped while `data` and
    /// `pads` point into it.
    _peers: Vec<Option<Box<dyn Mapping>>>,
    data: Vec<u64>,
    pads: Vec<u64>,
    buffer: Arc<Buffer>,
    /// The same on every rank's handle of one rendezvous and different for
    /// every rendezvous (rank 0's random token), so ranks can tell whether
    /// they hold the same symmetric memory.
    id: u64,
}

impl Handle {
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buffer
    }
    pub fn group(&self) -> &Arc<Group> {
        &self.buffer.group
    }
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Address, in this process, of `rank`'s data.
    pub fn peer_addr(&self, rank: usize) -> Result<u64> {
        self.reachable(rank)?;
        self.data.get(rank).copied().ok_or_else(|| self.bad_rank(rank))
    }
    /// Address, in this process, of `rank`'s signal pad.
    pub fn pad_addr(&self, rank: usize) -> Result<u64> {
        self.reachable(rank)?;
        self.pads.get(rank).copied().ok_or_else(|| self.bad_rank(rank))
    }
    /// `Unsupported` for a rank on another host: no pointer here reaches
    /// its memory.
    fn reachable(&self, rank: usize) -> Result<()> {
        let t = self.group().topology();
        match t.host_of(rank) {
            Some(h) if !t.is_local(rank) => Err(err!(
                Unsupported,
                "rank {rank} is on another host ({:?}): its memory is not mapped here; the ranks on this host are {:?}",
                t.host_id(h).unwrap_or_default(),
                t.local_ranks()
            )),
            _ => Ok(()),
        }
    }
    fn bad_rank(&self, rank: usize) -> crate::error::Error {
        err!(InvalidArgument, "rank {rank} is out of range for a group of {}", self.data.len())
    }
    /// `tag`: the call's ([`CallTag::USER`] for the public API's signals).
    pub fn put_signal(&self, peer: usize, channel: usize, tag: CallTag, stream: Stream) -> Result<()> {
        self.reachable(peer)?;
        self.signalling(|s, t| s.put(peer, channel, tag, stream, t))
    }
    pub fn wait_signal(&self, peer: usize, channel: usize, tag: CallTag, stream: Stream) -> Result<()> {
        self.reachable(peer)?;
        self.signalling(|s, t| s.wait(peer, channel, tag, stream, t))
    }
    /// Over the ranks of this rank's host (every rank, in a group on one host).
    pub fn barrier(&self, channel: usize, tag: CallTag, stream: Stream) -> Result<()> {
        self.signalling(|s, t| s.barrier(channel, tag, stream, t))
    }
    /// A signal call on a healthy group; one that times out or is cut
    /// short fails the group (its pads are out of step now).
    fn signalling(&self, f: impl FnOnce(&dyn Signals, std::time::Duration) -> Result<()>) -> Result<()> {
        let group = self.group();
        group.check_healthy()?;
        f(&*self.signals, group.timeout()).inspect_err(|e| {
            if !matches!(e.kind, ErrorKind::InvalidArgument | ErrorKind::Unsupported) {
                group.fail(e)
            }
        })
    }
    /// Address here of the `u32` flag at byte `offset` of `rank`'s buffer.
    fn flag_addr(&self, rank: usize, offset: usize) -> Result<u64> {
        let size = self.buffer.size;
        if offset % 4 != 0 || offset.checked_add(4).is_none_or(|end| end > size) {
            return Err(err!(
                InvalidArgument,
                "offset {offset} is not a 4-byte aligned u32 inside the buffer's {size} bytes"
            ));
        }
        Ok(self.peer_addr(rank)? + offset as u64)
    }
    /// Stream-ordered: sets the `u32` at `offset` of `rank`'s buffer to `value`.
    pub fn write_value(&self, rank: usize, offset: usize, value: u32, stream: Stream) -> Result<()> {
        let addr = self.flag_addr(rank, offset)?;
        self.signalling(|s, _| s.write_value(addr, value, stream))
    }
    /// Stream-ordered: waits until the `u32` at `offset` of `rank`'s buffer is >= `value`.
    pub fn wait_value(&self, rank: usize, offset: usize, value: u32, stream: Stream) -> Result<()> {
        let addr = self.flag_addr(rank, offset)?;
        self.signalling(|s, t| s.wait_value(addr, value, rank, stream, t))
    }
}

/// What each rank announces about its buffer at rendezvous.
struct Announce {
    size: u64,
    total: u64,
    token: u64,
    server: Vec<u8>,
}

impl Announce {
    fn encode(&self) -> Vec<u8> {
        Writer::new().u64(self.size).u64(self.total).u64(self.token).bytes(&self.server).finish()
    }
    fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader::new(b, "rendezvous announcement");
        Ok(Announce { size: r.u64()?, total: r.u64()?, token: r.u64()?, server: r.bytes()?.to_vec() })
    }
}

/// Collective: maps every rank's copy of `buffer` into this rank, and
/// registers the handle with the group (see [`find_symmetric`]).
pub fn rendezvous(buffer: &Arc<Buffer>) -> Result<Arc<Handle>> {
    let _lock = buffer.group.lock_collective();
    buffer.group.check_healthy()?;
    rendezvous_locked(buffer)
}

/// [`rendezvous`] for a caller that holds the group's collective lock.
///
/// Three exchanges: announce (size, where to fetch our fd), then every rank
/// fetches and maps its peers' fds, then all confirm, so our fd stays
/// published until every peer holds it and a failure anywhere fails everyone.
pub fn rendezvous_locked(buffer: &Arc<Buffer>) -> Result<Arc<Handle>> {
    let group = buffer.group.clone();
    let (rank, world) = (group.rank(), group.world());

    let publish = || -> Result<(ipc::Publication, Announce)> {
        let server = ipc::fd_server()?;
        let mut token = [0u8; 8];
        getrandom::fill(&mut token).map_err(|e| err!(System, "getrandom: {e}"))?;
        let token = u64::from_le_bytes(token);
        let fd = buffer.alloc.export_fd()?;
        let publication = server.publish(token, *group.secret(), fd.as_fd())?;
        let announce =
            Announce { size: buffer.size as u64, total: buffer.total() as u64, token, server: server.name().to_vec() };
        Ok((publication, announce))
    };
    let published = publish();
    let announced =
        group.exchange(Purpose::Announce, published.as_ref().map(|(_, a)| a.encode()).map_err(|e| e.clone()))?;
    let _publication = published?.0;
    let peers: Vec<Announce> = group.decoded(announced.iter().map(|b| Announce::decode(b)).collect())?;

    // Everything that allocates happens before the last exchange: once it
    // passes, a peer may be spinning in a kernel on the device, and a
    // device-synchronizing call here (cuMemAlloc, say) could wait for it
    // when the two ranks share one device.
    let mapped = check_sizes(&peers, rank).and_then(|_| map_peers(buffer, &peers)).and_then(|peers_mapped| {
        let topology = group.topology();
        let data: Vec<u64> = (0..world)
            .map(|r| match &peers_mapped[r] {
                Some(m) => m.addr(),
                None if r == rank => buffer.addr(),
                None => 0, // on another host
            })
            .collect();
        let pads: Vec<u64> = data
            .iter()
            .enumerate()
            .map(|(r, &a)| if topology.is_local(r) { a + buffer.pad_offset as u64 } else { 0 })
            .collect();
        let signals = group.backend().signals(PadSet { rank, world, pads: pads.clone() })?;
        Ok((peers_mapped, data, pads, signals))
    });
    group.exchange(Purpose::Mapped, mapped.as_ref().map(|_| Vec::new()).map_err(|e| e.clone()))?;
    let (peers_mapped, data, pads, signals) = mapped?;
    let handle =
        Arc::new(Handle { signals, _peers: peers_mapped, data, pads, buffer: buffer.clone(), id: peers[0].token });
    group.attachment::<Symmetric>().register(&handle);
    Ok(handle)
}

/// Every live rendezvoused handle of a group, by the address range of this
/// rank's data (a group [`Attachment`]): what [`find_symmetric`] searches.
#[derive(Default)]
struct Symmetric(Mutex<Vec<(Range<u64>, Weak<Handle>)>>);

impl Attachment for Symmetric {}

impl Symmetric {
    fn register(&self, h: &Arc<Handle>) {
        let start = h.buffer().addr();
        let mut reg = lock(&self.0);
        reg.retain(|(_, w)| w.strong_count() > 0);
        reg.push((start..start + h.buffer().size() as u64, Arc::downgrade(h)));
    }
}

/// A live rendezvoused handle of `group` whose data on this rank holds all
/// of `range`.
pub fn find_symmetric(group: &Group, range: Range<u64>) -> Option<Arc<Handle>> {
    let reg = group.attachment::<Symmetric>();
    let reg = lock(&reg.0);
    reg.iter().filter(|(r, _)| r.start <= range.start && range.end <= r.end).find_map(|(_, w)| w.upgrade())
}

/// Every rank must have allocated the same size; report all that differ.
fn check_sizes(peers: &[Announce], me: usize) -> Result<()> {
    let mine = peers[me].size;
    let differ: Vec<String> = peers
        .iter()
        .enumerate()
        .filter(|(_, a)| a.size != mine)
        .map(|(r, a)| format!("rank {r} has {} bytes", a.size))
        .collect();
    if differ.is_empty() {
        Ok(())
    } else {
        Err(err!(Mismatch, "buffer sizes differ between ranks: rank {me} has {mine} bytes, {}", differ.join(", ")))
    }
}

/// Maps the buffers of this rank's peers on its host (`None` for itself
/// and for ranks on other hosts, whose memory no mapping here reaches).
fn map_peers(buffer: &Buffer, peers: &[Announce]) -> Result<Vec<Option<Box<dyn Mapping>>>> {
    let group = &buffer.group;
    let mut out = Vec::with_capacity(peers.len());
    for (r, a) in peers.iter().enumerate() {
        if r == group.rank() || !group.topology().is_local(r) {
            out.push(None);
            continue;
        }
        let fd = ipc::fetch_fd(&a.server, a.token, group.secret(), group.timeout())
            .map_err(|e| e.context(format!("fetching rank {r}'s buffer")))?;
        let m = group
            .backend()
            .import(fd, a.total as usize)
            .map_err(|e| e.context(format!("mapping rank {r}'s buffer")))?;
        out.push(Some(m));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::ops::testing::{on_each, on_hosts};

    /// In a group spanning hosts, a rendezvous maps the buffers of the
    /// ranks on this rank's host only: their data is reached and they
    /// signal each other (slots named by group rank); a rank on another
    /// host is refused with `Unsupported`; a barrier is over the host's
    /// ranks alone (the other host's ranks never join it).
    #[test]
    fn rendezvous_across_hosts_maps_the_ranks_of_this_host() {
        let hosts = ["a", "b", "a", "b"];
        let groups = on_hosts(&hosts);
        let handles = on_each(&groups, |r, g| {
            let b = Buffer::create(g, 64).unwrap();
            // SAFETY: the host backend's buffer is this process's memory.
            unsafe { *(b.addr() as *mut u32) = 100 + r as u32 };
            rendezvous(&b).unwrap()
        });
        on_each(&groups, |r, _| {
            let h = &handles[r];
            for p in 0..hosts.len() {
                if hosts[p] == hosts[r] {
                    // SAFETY: a peer on this host is mapped here.
                    let v = unsafe { *(h.peer_addr(p).unwrap() as *const u32) };
                    assert_eq!(v, 100 + p as u32);
                    assert!(h.pad_addr(p).unwrap() != 0);
                    continue;
                }
                for e in [
                    h.peer_addr(p).unwrap_err(),
                    h.pad_addr(p).unwrap_err(),
                    h.put_signal(p, 1, CallTag::USER, Stream(0)).unwrap_err(),
                    h.wait_signal(p, 1, CallTag::USER, Stream(0)).unwrap_err(),
                ] {
                    assert_eq!(e.kind, ErrorKind::Unsupported, "{}", e.msg);
                    assert!(e.msg.contains("another host"), "{}", e.msg);
                }
            }
            let partner = (0..hosts.len()).find(|&p| p != r && hosts[p] == hosts[r]).unwrap();
            if hosts[r] == "a" {
                h.barrier(2, CallTag::USER, Stream(0)).unwrap();
            } else {
                h.put_signal(partner, 1, CallTag::USER, Stream(0)).unwrap();
                h.wait_signal(partner, 1, CallTag::USER, Stream(0)).unwrap();
            }
        });
        assert!(groups.iter().all(|g| g.check_healthy().is_ok()));
    }
}
