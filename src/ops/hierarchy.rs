//! The operations' plans across hosts, as pure functions of the group's
//! [`Topology`]: what each level does, inside a host (where ranks map each
//! other's memory) and across hosts (where only the group's transport
//! across hosts reaches, over the ranks with the same local index).
//!
//! Every host must hold as many ranks (else `Unsupported`): each rank then
//! has exactly one partner of its local index on every other host.
//!
//! A *piece* is one rank's share of an operation, named by that rank: the
//! rows it contributes to a gather, or the chunk it receives from a
//! reduce-scatter. Pieces are laid out in rank order whatever the
//! placement, so ranks of one host need not be consecutive.
//!
//! - all-reduce: reduce-scatter inside the host (local rank j keeps slice
//!   j of its host's sum), all-reduce of each slice across hosts, then
//!   all-gather of the slices inside the host. Sums are taken per host in
//!   local order, then across hosts in host order.
//! - gather (`lc_allgather`, `fused_ag_mm`'s A): all-gather of each rank's
//!   piece across hosts, then inside the host each rank takes from local
//!   rank j the pieces j holds (those of every rank with local index j).
//! - reduce-scatter (`mm_rs`): reduce-scatter inside the host, local rank j
//!   receiving its host's sum of the chunks of every rank with local index
//!   j; then reduce-scatter of those across hosts, each rank keeping its own.

// The operations across hosts are built on these plans one at a time.
#![allow(dead_code)]

use crate::error::Result;
use crate::topology::Topology;
use std::ops::Range;

/// A group's ranks by host and local index, seen from one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hierarchy {
    /// `hosts[h][j]`: the rank with local index j on host h.
    hosts: Vec<Vec<usize>>,
    host: usize,
    local: usize,
}

impl Hierarchy {
    /// `what`'s levels; `Unsupported` unless every host has as many ranks.
    pub fn new(topology: &Topology, rank: usize, what: &str) -> Result<Hierarchy> {
        topology.require_equal_hosts(what)?;
        let hosts = (0..topology.hosts()).map(|h| topology.ranks_on(h)).collect();
        let host = topology.host_of(rank).unwrap_or(0);
        Ok(Hierarchy { hosts, host, local: topology.local_rank() })
    }

    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }

    pub fn local_world(&self) -> usize {
        self.hosts[0].len()
    }

    pub fn world(&self) -> usize {
        self.hosts() * self.local_world()
    }

    /// This rank's local index.
    pub fn local_index(&self) -> usize {
        self.local
    }

    /// The ranks of this rank's host, by local index.
    pub fn local_ranks(&self) -> &[usize] {
        &self.hosts[self.host]
    }

    /// The ranks with local index `j` on every host, in host order.
    pub fn with_local_index(&self, j: usize) -> Vec<usize> {
        self.hosts.iter().map(|ranks| ranks[j]).collect()
    }

    /// The members of this rank's transport across hosts, in host order.
    pub fn across(&self) -> Vec<usize> {
        self.with_local_index(self.local)
    }
}

/// The rows of piece `piece` when every piece has `rows` rows.
pub fn piece_rows(piece: usize, rows: usize) -> Range<usize> {
    piece * rows..(piece + 1) * rows
}

/// All-reduce of `count` elements (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllReducePlan {
    /// Step 1, inside the host (reduce-scatter over `local_ranks`): local
    /// rank j keeps `slices[j]` of its host's sum. Step 3 (all-gather over
    /// `local_ranks`) gives every local rank every slice.
    pub local_ranks: Vec<usize>,
    pub slices: Vec<Range<usize>>,
    /// Step 2: all-reduce of this rank's slice over these ranks (host order).
    pub across: Vec<usize>,
    /// The slices' length before the last ones are cut at the end of the
    /// buffer: padded to blocks of this many, each level moves equal blocks.
    pub block: usize,
    local: usize,
}

impl AllReducePlan {
    /// Slices start at multiples of `align` elements (at least 1), so that
    /// each is as aligned as the buffer; trailing slices may be empty.
    pub fn new(h: &Hierarchy, count: usize, align: usize) -> AllReducePlan {
        let (lw, align) = (h.local_world(), align.max(1));
        let chunk = count.div_ceil(lw).div_ceil(align) * align;
        let slices = (0..lw).map(|j| (j * chunk).min(count)..((j + 1) * chunk).min(count)).collect();
        AllReducePlan {
            local_ranks: h.local_ranks().to_vec(),
            slices,
            across: h.across(),
            block: chunk,
            local: h.local_index(),
        }
    }

    /// This rank's slice: the one it reduces across hosts.
    pub fn mine(&self) -> Range<usize> {
        self.slices[self.local].clone()
    }

    /// Elements this rank sends across hosts: its slice, to each other host
    /// (an upper bound; a ring sends `2 (hosts - 1) / hosts` of it).
    pub fn across_elements(&self) -> usize {
        self.mine().len() * (self.across.len() - 1)
    }
}

/// A gather of every rank's piece into every rank's output, in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatherPlan {
    /// Step 1: all-gather of this rank's piece over these ranks (host
    /// order); member h's piece is rank `across[h]`'s.
    pub across: Vec<usize>,
    /// Step 2, inside the host: from each local rank, by local index, the
    /// pieces it holds after step 1 (in host order). A rank's own entry
    /// is what it already holds.
    pub inside: Vec<(usize, Vec<usize>)>,
}

impl GatherPlan {
    pub fn new(h: &Hierarchy) -> GatherPlan {
        let inside = h.local_ranks().iter().enumerate().map(|(j, &r)| (r, h.with_local_index(j))).collect();
        GatherPlan { across: h.across(), inside }
    }

    /// The ranks of this rank's host, by local index.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.inside.iter().map(|x| x.0).collect()
    }

    /// Pieces this rank receives at each level: (inside, across).
    pub fn received(&self) -> (usize, usize) {
        let others = self.inside.len() - 1;
        (others * self.across.len(), self.across.len() - 1)
    }
}

/// A reduce-scatter: rank r receives the reduction over ranks of their
/// piece r.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScatterPlan {
    /// Step 1, inside the host (reduce-scatter over `local_ranks`): local
    /// rank j receives its host's reduction of the pieces `pieces[j]` (those
    /// of the ranks with local index j, in host order).
    pub local_ranks: Vec<usize>,
    pub pieces: Vec<Vec<usize>>,
    /// Step 2: reduce-scatter over these ranks (host order) of the pieces
    /// step 1 left here; member h keeps piece `across[h]`, its own.
    pub across: Vec<usize>,
}

impl ScatterPlan {
    pub fn new(h: &Hierarchy) -> ScatterPlan {
        let pieces = (0..h.local_world()).map(|j| h.with_local_index(j)).collect();
        ScatterPlan { local_ranks: h.local_ranks().to_vec(), pieces, across: h.across() }
    }

    /// Pieces this rank sends at each level: (inside, across).
    pub fn sent(&self) -> (usize, usize) {
        ((self.local_ranks.len() - 1) * self.across.len(), self.across.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// Placements: every host as many ranks, contiguous, interleaved,
    /// scattered, one host, one rank per host.
    const PLACEMENTS: &[&[&str]] = &[
        &["a"],
        &["a", "a"],
        &["a", "b"],
        &["a", "a", "a", "a"],
        &["a", "a", "b", "b"],
        &["a", "b", "a", "b"],
        &["a", "b", "b", "a"],
        &["a", "b", "c", "d"],
        &["b", "a", "c", "c", "a", "b"],
        &["a", "b", "a", "b", "a", "b", "a", "b"],
        &["a", "a", "a", "a", "b", "b", "b", "b"],
    ];

    /// Every rank's view of `names`.
    fn views(names: &[&str]) -> Vec<Hierarchy> {
        let ids: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        (0..ids.len()).map(|r| Hierarchy::new(&Topology::new(&ids, r), r, "test").unwrap()).collect()
    }

    /// Each level's members agree on who they are, share a host (inside)
    /// or sit one per host (across), and include the rank itself.
    fn check_members(names: &[&str], views: &[Hierarchy], rank: usize, inside: &[usize], across: &[usize]) {
        assert!(inside.contains(&rank) && across.contains(&rank));
        assert!(inside.iter().all(|&m| names[m] == names[rank]));
        let mut hosts: Vec<&str> = across.iter().map(|&m| names[m]).collect();
        hosts.dedup();
        assert_eq!(hosts.len(), across.len(), "{across:?}");
        for &m in across {
            assert_eq!(views[m].across(), across, "rank {m} of {across:?}");
        }
        for &m in inside {
            assert_eq!(views[m].local_ranks(), inside);
        }
    }

    #[test]
    fn levels() {
        let v = views(&["a", "b", "b", "a"]);
        assert_eq!((v[2].hosts(), v[2].local_world(), v[2].world(), v[2].local_index()), (2, 2, 4, 1));
        assert_eq!(v[2].local_ranks(), &[1, 2]);
        assert_eq!(v[2].across(), vec![3, 2]);
        assert_eq!(v[0].across(), vec![0, 1]);
        for names in PLACEMENTS {
            let v = views(names);
            for (r, h) in v.iter().enumerate() {
                check_members(names, &v, r, h.local_ranks(), &h.across());
                assert_eq!(h.world(), names.len());
            }
        }
    }

    #[test]
    fn unequal_hosts_are_unsupported() {
        let ids: Vec<String> = ["a", "a", "b"].iter().map(|s| s.to_string()).collect();
        for r in 0..3 {
            let e = Hierarchy::new(&Topology::new(&ids, r), r, "symm_lc_allgather").unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unsupported);
            assert!(e.msg.starts_with("symm_lc_allgather: this group's hosts have different numbers"), "{}", e.msg);
        }
    }

    /// Counts of each rank's contributions: what a value sums.
    type Sum = Vec<u32>;

    fn add(a: &Sum, b: &Sum) -> Sum {
        a.iter().zip(b).map(|(x, y)| x + y).collect()
    }

    fn only(world: usize, r: usize) -> Sum {
        (0..world).map(|i| (i == r) as u32).collect()
    }

    /// Runs every rank's all-reduce plan over symbolic sums: every element
    /// of every rank ends holding each rank once.
    #[test]
    fn all_reduce_reduces_everything_once() {
        for names in PLACEMENTS {
            let v = views(names);
            let world = names.len();
            for (count, align) in [(0, 1), (1, 1), (7, 1), (13, 4), (64, 8), (3, 16)] {
                let plans: Vec<AllReducePlan> = v.iter().map(|h| AllReducePlan::new(h, count, align)).collect();
                for (r, p) in plans.iter().enumerate() {
                    check_members(names, &v, r, &p.local_ranks, &p.across);
                    // The slices tile the buffer, aligned, and the ranks agree on them.
                    assert_eq!(p.slices.first().unwrap().start, 0);
                    assert_eq!(p.slices.last().unwrap().end, count);
                    assert!(p.slices.windows(2).all(|w| w[0].end == w[1].start));
                    assert!(p.slices.iter().all(|s| s.is_empty() || s.start % align == 0));
                    assert!(p.local_ranks.iter().all(|&m| plans[m].slices == p.slices));
                    assert!(p.block % align == 0 && p.block * p.slices.len() >= count);
                    assert!(p
                        .slices
                        .iter()
                        .enumerate()
                        .all(|(j, s)| s.len() <= p.block && s.start == (j * p.block).min(count)));
                }
                let mut data: Vec<Vec<Sum>> = (0..world).map(|r| vec![only(world, r); count]).collect();
                // Step 1: each rank's slice summed over its host.
                let step1: Vec<Vec<Sum>> = plans
                    .iter()
                    .map(|p| {
                        p.mine()
                            .map(|i| p.local_ranks.iter().fold(vec![0; world], |s, &m| add(&s, &data[m][i])))
                            .collect()
                    })
                    .collect();
                // Step 2: across hosts.
                let step2: Vec<Vec<Sum>> = plans
                    .iter()
                    .map(|p| {
                        (0..p.mine().len())
                            .map(|i| p.across.iter().fold(vec![0; world], |s, &m| add(&s, &step1[m][i])))
                            .collect()
                    })
                    .collect();
                // Step 3: gather the slices inside the host.
                for (r, p) in plans.iter().enumerate() {
                    for (j, &m) in p.local_ranks.iter().enumerate() {
                        for (k, i) in p.slices[j].clone().enumerate() {
                            data[r][i] = step2[m][k].clone();
                        }
                    }
                }
                for (r, d) in data.iter().enumerate() {
                    assert!(d.iter().all(|s| s.iter().all(|&c| c == 1)), "{names:?} count {count} rank {r}: {d:?}");
                }
                for p in &plans {
                    assert_eq!(p.across_elements(), p.mine().len() * (v[0].hosts() - 1));
                }
            }
        }
    }

    /// Runs every rank's gather plan over the pieces each holds: every
    /// rank ends with every piece, each step taking only what its source
    /// holds by then.
    #[test]
    fn gather_delivers_every_piece_in_rank_order() {
        for names in PLACEMENTS {
            let v = views(names);
            let world = names.len();
            let plans: Vec<GatherPlan> = v.iter().map(GatherPlan::new).collect();
            let mut held: Vec<Vec<bool>> = (0..world).map(|r| (0..world).map(|p| p == r).collect()).collect();
            let start = held.clone();
            for (r, p) in plans.iter().enumerate() {
                let inside = p.local_ranks();
                check_members(names, &v, r, &inside, &p.across);
                for &m in &p.across {
                    assert!(start[m][m]);
                    held[r][m] = true;
                }
            }
            let after1 = held.clone();
            for (r, p) in plans.iter().enumerate() {
                for (m, pieces) in &p.inside {
                    for &piece in pieces {
                        assert!(after1[*m][piece], "{names:?}: rank {r} takes piece {piece} from {m}, who lacks it");
                        held[r][piece] = true;
                    }
                }
                assert!(held[r].iter().all(|&h| h), "{names:?} rank {r}");
                let (l, a) = (v[r].local_world(), v[r].hosts());
                assert_eq!(p.received(), ((l - 1) * a, a - 1));
                // Inside and across together receive every other piece once.
                assert_eq!(p.received().0 + p.received().1, world - 1);
            }
        }
        assert_eq!(piece_rows(2, 3), 6..9);
    }

    /// Runs every rank's reduce-scatter plan over symbolic sums: rank r
    /// ends with its piece holding each rank once.
    #[test]
    fn scatter_reduces_each_piece_to_its_rank() {
        for names in PLACEMENTS {
            let v = views(names);
            let world = names.len();
            let plans: Vec<ScatterPlan> = v.iter().map(ScatterPlan::new).collect();
            // Step 1: local rank j gets its host's sum of pieces[j].
            let step1: Vec<Vec<(usize, Sum)>> = plans
                .iter()
                .enumerate()
                .map(|(r, p)| {
                    check_members(names, &v, r, &p.local_ranks, &p.across);
                    assert_eq!(p.pieces[v[r].local_index()], p.across);
                    p.across
                        .iter()
                        .map(|&piece| {
                            (piece, p.local_ranks.iter().fold(vec![0; world], |s, &m| add(&s, &only(world, m))))
                        })
                        .collect()
                })
                .collect();
            for (r, p) in plans.iter().enumerate() {
                let h = p.across.iter().position(|&m| m == r).unwrap();
                let mut sum = vec![0; world];
                for &m in &p.across {
                    let (piece, s) = &step1[m][h];
                    assert_eq!(*piece, r);
                    sum = add(&sum, s);
                }
                assert!(sum.iter().all(|&c| c == 1), "{names:?} rank {r}: {sum:?}");
                let (l, a) = (v[r].local_world(), v[r].hosts());
                assert_eq!(p.sent(), ((l - 1) * a, a - 1));
            }
        }
    }
}
