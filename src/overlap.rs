//! Whether two strided arrays share a byte, decided exactly rather than by
//! their byte ranges, so that interleaved outputs (one array's elements in
//! the other's gaps) are accepted.
//!
//! Element `i` of an array lies at `addr + size * sum(i[k] * stride[k])`.
//! Two arrays share a byte when some element of each satisfies
//! `-size_a < x_a - x_b < size_b`: a bounded integer problem over the
//! indices of both arrays. Terms with the same coefficient merge into one
//! (the sums of two index ranges are again a range), which turns the usual
//! case, equal strides, into one variable per dimension. A depth-first
//! search, largest coefficient first, keeps only the values for which the
//! smaller terms can still reach the target; for arrays whose dimensions
//! nest (each stride steps past what the smaller ones span) that leaves at
//! most two values per level. Past a fixed amount of work the answer is
//! "they may share", which is what a caller rejecting overlap wants.

use crate::array::Array;

/// Nodes the search may visit before answering "may share".
const BUDGET: usize = 100_000;

/// One merged term of the sum: `coef * v` with `lo <= v <= hi`.
#[derive(Clone, Copy, Debug)]
struct Term {
    coef: i128,
    lo: i128,
    hi: i128,
}

impl Term {
    fn min(&self) -> i128 {
        self.coef * if self.coef >= 0 { self.lo } else { self.hi }
    }
    fn max(&self) -> i128 {
        self.coef * if self.coef >= 0 { self.hi } else { self.lo }
    }
}

/// Whether `a` and `b` may share a byte: `false` only when they share none.
pub fn may_share(a: &Array, b: &Array) -> bool {
    let (sa, sb) = (a.dtype.size() as i128, b.dtype.size() as i128);
    let mut terms: Vec<Term> = Vec::new();
    let mut add = |coef: i128, n: usize| {
        let hi = n as i128 - 1;
        if coef == 0 || hi == 0 {
            return;
        }
        // Terms of equal |coef| merge: v1 + v2 over two ranges is a range
        // (a negative coefficient flips its range first).
        let (coef, lo, hi) = if coef < 0 { (-coef, -hi, 0) } else { (coef, 0, hi) };
        match terms.iter_mut().find(|t| t.coef == coef) {
            Some(t) => {
                t.lo += lo;
                t.hi += hi;
            }
            None => terms.push(Term { coef, lo, hi }),
        }
    };
    for (&n, &s) in a.shape.iter().zip(&a.strides) {
        add(s as i128 * sa, n);
    }
    for (&n, &s) in b.shape.iter().zip(&b.strides) {
        add(-(s as i128 * sb), n);
    }
    terms.sort_unstable_by_key(|t| std::cmp::Reverse(t.coef));
    // x_a - x_b = addr_a - addr_b + sum(terms); it must lie in (-sa, sb).
    let base = a.addr as i128 - b.addr as i128;
    let (lo, hi) = (-sa + 1 - base, sb - 1 - base);
    // rest[k]: the range the terms from k on can reach.
    let mut rest = vec![(0i128, 0i128); terms.len() + 1];
    for k in (0..terms.len()).rev() {
        rest[k] = (rest[k + 1].0 + terms[k].min(), rest[k + 1].1 + terms[k].max());
    }
    let mut budget = BUDGET;
    reach(&terms, &rest, 0, lo, hi, &mut budget) != Some(false)
}

/// Whether the terms from `k` on can sum into `[lo, hi]`; `None` when the
/// budget ran out first.
fn reach(terms: &[Term], rest: &[(i128, i128)], k: usize, lo: i128, hi: i128, budget: &mut usize) -> Option<bool> {
    if hi < lo || hi < rest[k].0 || rest[k].1 < lo {
        return Some(false);
    }
    if k == terms.len() {
        return Some(true); // the empty sum, 0, is in [lo, hi]
    }
    let t = terms[k];
    let (rlo, rhi) = rest[k + 1];
    // coef > 0: coef * v + r in [lo, hi] with r in [rlo, rhi].
    let first = div_ceil(lo - rhi, t.coef).max(t.lo);
    let last = div_floor(hi - rlo, t.coef).min(t.hi);
    let mut v = first;
    while v <= last {
        *budget = budget.checked_sub(1)?;
        if reach(terms, rest, k + 1, lo - t.coef * v, hi - t.coef * v, budget)? {
            return Some(true);
        }
        v += 1;
    }
    Some(false)
}

fn div_floor(a: i128, b: i128) -> i128 {
    a.div_euclid(b)
}

fn div_ceil(a: i128, b: i128) -> i128 {
    -((-a).div_euclid(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::DType;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn arr(addr: u64, dtype: DType, shape: &[usize], strides: &[usize]) -> Array {
        Array { addr, dtype, shape: shape.to_vec(), strides: strides.to_vec() }
    }

    /// Every byte the array's elements cover, by enumeration.
    fn bytes(a: &Array) -> HashSet<u64> {
        let mut out = HashSet::new();
        let mut idx = vec![0usize; a.ndim()];
        loop {
            let off: usize = idx.iter().zip(&a.strides).map(|(i, s)| i * s).sum();
            let start = a.addr + (off * a.dtype.size()) as u64;
            out.extend(start..start + a.dtype.size() as u64);
            let mut d = a.ndim();
            loop {
                if d == 0 {
                    return out;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < a.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }

    #[test]
    fn interleaved_arrays_share_nothing() {
        // Even and odd columns of one [4, 8] bf16 matrix.
        let even = arr(4096, DType::BF16, &[4, 4], &[8, 2]);
        let odd = arr(4098, DType::BF16, &[4, 4], &[8, 2]);
        assert!(!may_share(&even, &odd));
        assert!(may_share(&even, &arr(4096 + 16, DType::BF16, &[4, 4], &[8, 2])));
        // Half an element apart: bytes are shared.
        assert!(may_share(&even, &arr(4097, DType::BF16, &[4, 4], &[8, 2])));
        // The rows of one, the gaps of the other.
        let rows = arr(0, DType::F32, &[3, 5], &[10, 1]);
        assert!(!may_share(&rows, &arr(20, DType::F32, &[3, 5], &[10, 1])));
        assert!(may_share(&rows, &arr(16, DType::F32, &[3, 5], &[10, 1])));
    }

    #[test]
    fn huge_strides_do_not_overflow() {
        let a = arr(0, DType::F32, &[2, 8], &[1 << 60, 1]);
        let b = arr(4, DType::F32, &[2, 8], &[1 << 60, 1]);
        assert!(may_share(&a, &b));
        assert!(!may_share(&a, &arr(32, DType::F32, &[2, 8], &[1 << 60, 1])));
    }

    fn small_array() -> impl Strategy<Value = Array> {
        let dtype = prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F8E4M3)];
        (0u64..48, dtype, prop::collection::vec((1usize..5, 0usize..12), 1..4)).prop_map(|(addr, dtype, dims)| {
            let (shape, strides) = dims.into_iter().unzip::<_, _, Vec<_>, Vec<_>>();
            Array { addr: 4096 + addr, dtype, shape, strides }
        })
    }

    proptest! {
        /// Small arrays never exhaust the budget, so the answer is exact.
        #[test]
        fn agrees_with_enumeration(a in small_array(), b in small_array()) {
            let brute = !bytes(&a).is_disjoint(&bytes(&b));
            prop_assert_eq!(may_share(&a, &b), brute);
        }

        /// Same strides, shifted starts: the case outputs most often have.
        #[test]
        fn same_strides_agree_with_enumeration(a in small_array(), shift in 0u64..64) {
            let b = Array { addr: a.addr + shift, ..a.clone() };
            prop_assert_eq!(may_share(&a, &b), !bytes(&a).is_disjoint(&bytes(&b)));
        }
    }
}
