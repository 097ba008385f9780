//! Which ranks of a group share a host: learnt once, when the group forms,
//! from every rank's host identity (hostname and boot id, or
//! `SYMM_HOST_ID`). Ranks on one host can map each other's memory; ranks
//! on different hosts reach each other only through a network library.
//!
//! Hosts are numbered in the order their first rank appears, so every rank
//! computes the same numbering from the same list.

use crate::error::{err, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    rank: usize,
    /// `host[r]`: the index of rank r's host.
    host: Vec<usize>,
    /// Each host's identity, by index.
    ids: Vec<String>,
}

impl Topology {
    /// The topology seen by `rank` of a group whose rank r announced
    /// `host_ids[r]`.
    pub fn new(host_ids: &[String], rank: usize) -> Topology {
        let mut ids: Vec<String> = Vec::new();
        let host = host_ids
            .iter()
            .map(|id| match ids.iter().position(|h| h == id) {
                Some(i) => i,
                None => {
                    ids.push(id.clone());
                    ids.len() - 1
                }
            })
            .collect();
        Topology { rank, host, ids }
    }

    /// Number of hosts the group spans.
    pub fn hosts(&self) -> usize {
        self.ids.len()
    }

    /// Whether every rank is on one host.
    pub fn single_host(&self) -> bool {
        self.hosts() <= 1
    }

    /// The index of `rank`'s host (`None`: no such rank).
    pub fn host_of(&self, rank: usize) -> Option<usize> {
        self.host.get(rank).copied()
    }

    /// The identity of host `index`.
    pub fn host_id(&self, index: usize) -> Option<&str> {
        self.ids.get(index).map(String::as_str)
    }

    /// The ranks on host `index`, in rank order.
    pub fn ranks_on(&self, index: usize) -> Vec<usize> {
        (0..self.host.len()).filter(|&r| self.host[r] == index).collect()
    }

    /// The ranks on this rank's host (itself included), in rank order.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.ranks_on(self.host[self.rank])
    }

    /// This rank's place among [`Self::local_ranks`].
    pub fn local_rank(&self) -> usize {
        self.host[..self.rank].iter().filter(|&&h| h == self.host[self.rank]).count()
    }

    /// How many ranks share this rank's host.
    pub fn local_world(&self) -> usize {
        self.host.iter().filter(|&&h| h == self.host[self.rank]).count()
    }

    /// Whether `rank` is on this rank's host.
    pub fn is_local(&self, rank: usize) -> bool {
        self.host_of(rank) == Some(self.host[self.rank])
    }

    /// `Unsupported` for `what` unless every host has as many ranks: the
    /// plans across hosts pair each rank with one rank of every other host.
    pub fn require_equal_hosts(&self, what: &str) -> Result<()> {
        let counts: Vec<usize> = (0..self.hosts()).map(|h| self.ranks_on(h).len()).collect();
        if counts.windows(2).all(|w| w[0] == w[1]) {
            return Ok(());
        }
        Err(err!(
            Unsupported,
            "{what}: this group's hosts have different numbers of ranks ({}); operations across hosts need \
             the same number of ranks on every host",
            counts.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn one_host() {
        let t = Topology::new(&ids(&["a", "a", "a"]), 1);
        assert_eq!(t.hosts(), 1);
        assert!(t.single_host());
        assert_eq!(t.local_ranks(), vec![0, 1, 2]);
        assert_eq!((t.local_rank(), t.local_world()), (1, 3));
        let alone = Topology::new(&ids(&["a"]), 0);
        assert_eq!((alone.hosts(), alone.local_rank(), alone.local_world()), (1, 0, 1));
    }

    /// Hosts are numbered by their first rank, whatever their names' order.
    #[test]
    fn contiguous_placement() {
        let names = ids(&["z", "z", "b", "b"]);
        for rank in 0..4 {
            let t = Topology::new(&names, rank);
            assert_eq!(t.hosts(), 2);
            assert_eq!((0..4).map(|r| t.host_of(r).unwrap()).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
            assert_eq!(t.host_id(0), Some("z"));
            assert_eq!(t.host_id(1), Some("b"));
            assert_eq!(t.local_ranks(), if rank < 2 { vec![0, 1] } else { vec![2, 3] });
            assert_eq!((t.local_rank(), t.local_world()), (rank % 2, 2));
        }
    }

    #[test]
    fn interleaved_placement() {
        let names = ids(&["a", "b", "a", "b", "b"]);
        let t = Topology::new(&names, 3);
        assert_eq!(t.ranks_on(0), vec![0, 2]);
        assert_eq!(t.ranks_on(1), vec![1, 3, 4]);
        assert_eq!(t.local_ranks(), vec![1, 3, 4]);
        assert_eq!((t.local_rank(), t.local_world()), (1, 3));
        assert!(t.is_local(4) && !t.is_local(2));
        assert_eq!(t.host_of(5), None);
        assert!(!t.is_local(5));
        let t2 = Topology::new(&names, 2);
        assert_eq!((t2.local_rank(), t2.local_world()), (1, 2));
    }

    #[test]
    fn equal_hosts() {
        let t = Topology::new(&ids(&["a", "b", "a", "b"]), 3);
        assert!(t.require_equal_hosts("x").is_ok());
        let uneven = Topology::new(&ids(&["a", "b", "a"]), 1);
        let e = uneven.require_equal_hosts("symm_all_reduce").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unsupported);
        assert!(e.msg.contains("symm_all_reduce") && e.msg.contains("(2, 1)"), "{}", e.msg);
    }

    #[test]
    fn every_rank_its_own_host() {
        let names = ids(&["d", "c", "b", "a"]);
        for rank in 0..4 {
            let t = Topology::new(&names, rank);
            assert_eq!(t.hosts(), 4);
            assert_eq!(t.host_of(rank), Some(rank));
            assert_eq!(t.local_ranks(), vec![rank]);
            assert_eq!((t.local_rank(), t.local_world()), (0, 1));
        }
    }
}
