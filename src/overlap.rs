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
//!
//! [`self_overlap`] asks the same of two different indices of one array,
//! with the same search over the index differences.

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
    sums_into(&terms, lo, hi, &mut BUDGET.clone()) != Some(false)
}

/// Whether two different indices of `a` address the same element:
/// `Some(answer)`, or `None` where the search ran out of budget. Strides
/// count elements, so two elements share all their bytes or none, and
/// the question is whether `sum(d[k] * stride[k]) = 0` for some nonzero
/// `d` with `|d[k]| < shape[k]`.
pub fn self_overlap(a: &Array) -> Option<bool> {
    let mut dims: Vec<(usize, usize)> =
        a.strides.iter().copied().zip(a.shape.iter().copied()).filter(|&(_, n)| n > 1).collect();
    dims.sort_unstable();
    // A stride of 0, or one that two dimensions share, repeats an element.
    if dims.first().is_some_and(|&(s, _)| s == 0) || dims.windows(2).any(|w| w[0].0 == w[1].0) {
        return Some(true);
    }
    // The common layouts nest: each stride steps past all that the smaller
    // ones span, so no two indices meet, and no search is needed.
    let mut span = Some(0usize);
    for &(stride, n) in &dims {
        span = span.filter(|&sp| stride > sp).and_then(|sp| stride.checked_mul(n - 1)?.checked_add(sp));
    }
    if span.is_some() {
        return Some(false);
    }
    // d and -d both solve: search for solutions whose first nonzero term
    // (largest stride first) is positive, one case per such term.
    let terms: Vec<Term> =
        dims.iter().rev().map(|&(s, n)| Term { coef: s as i128, lo: 1 - n as i128, hi: n as i128 - 1 }).collect();
    let mut budget = BUDGET;
    for k in 0..terms.len() {
        let mut case = terms[k..].to_vec();
        case[0].lo = 1;
        if sums_into(&case, 0, 0, &mut budget)? {
            return Some(true);
        }
    }
    Some(false)
}

/// What the terms from some index on can sum to: at least `lo`, at most
/// `hi`, and always a multiple of `gcd` (0: no terms, the sum is 0).
#[derive(Clone, Copy)]
struct Rest {
    lo: i128,
    hi: i128,
    gcd: i128,
}

/// Whether the terms can sum into `[lo, hi]`; `None` when `budget` ran
/// out first.
fn sums_into(terms: &[Term], lo: i128, hi: i128, budget: &mut usize) -> Option<bool> {
    let mut rest = vec![Rest { lo: 0, hi: 0, gcd: 0 }; terms.len() + 1];
    for k in (0..terms.len()).rev() {
        let r = rest[k + 1];
        rest[k] = Rest { lo: r.lo + terms[k].min(), hi: r.hi + terms[k].max(), gcd: gcd(r.gcd, terms[k].coef) };
    }
    reach(terms, &rest, 0, lo, hi, budget)
}

/// Whether the terms from `k` on can sum into `[lo, hi]`; `None` when the
/// budget ran out first.
fn reach(terms: &[Term], rest: &[Rest], k: usize, lo: i128, hi: i128, budget: &mut usize) -> Option<bool> {
    if hi < lo || hi < rest[k].lo || rest[k].hi < lo {
        return Some(false);
    }
    if k == terms.len() {
        return Some(true); // the empty sum, 0, is in [lo, hi]
    }
    let t = terms[k];
    let r = rest[k + 1];
    // coef > 0: coef * v + r in [lo, hi] with r in [r.lo, r.hi].
    let mut v = div_ceil(lo - r.hi, t.coef).max(t.lo);
    let last = div_floor(hi - r.lo, t.coef).min(t.hi);
    let mut step = 1;
    // The later terms sum to multiples of their gcd, so to hit a single
    // value v must solve coef * v = lo modulo it: one residue class, where
    // trying every v would take as many steps as the term has values.
    if lo == hi && r.gcd > 1 {
        let h = gcd(t.coef, r.gcd);
        if lo.rem_euclid(h) != 0 {
            return Some(false);
        }
        let m = r.gcd / h;
        if let Some(v0) = residue(t.coef / h, lo / h, m) {
            v += (v0 - v).rem_euclid(m);
            step = m;
        }
    }
    while v <= last {
        *budget = budget.checked_sub(1)?;
        if reach(terms, rest, k + 1, lo - t.coef * v, hi - t.coef * v, budget)? {
            return Some(true);
        }
        v += step;
    }
    Some(false)
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 {
        a.abs()
    } else {
        gcd(b, a % b)
    }
}

/// The `v` in `0..m` with `c * v = t (mod m)`, `c` and `m` coprime; `None`
/// where the product would overflow (the caller then tries every `v`).
fn residue(c: i128, t: i128, m: i128) -> Option<i128> {
    Some(t.rem_euclid(m).checked_mul(inverse(c.rem_euclid(m), m))?.rem_euclid(m))
}

/// `x^-1 mod m` for `gcd(x, m) = 1` (extended Euclid; 0 where `m` is 1).
fn inverse(x: i128, m: i128) -> i128 {
    let (mut r0, mut r1, mut s0, mut s1) = (m, x, 0i128, 1i128);
    while r1 != 0 {
        let q = r0 / r1;
        (r0, r1) = (r1, r0 - q * r1);
        (s0, s1) = (s1, s0 - q * s1);
    }
    s0.rem_euclid(m)
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

    /// Distinct elements in layouts that do not nest are told apart from
    /// overlapping ones; a stride of 0 or one shared by two dimensions
    /// overlaps; searches past the budget say so.
    #[test]
    fn self_overlap_is_exact() {
        let f32s = |shape: &[usize], strides: &[usize]| arr(4096, DType::F32, shape, strides);
        // Offsets 0, 3, 2, 5, 4, 7.
        assert_eq!(self_overlap(&f32s(&[3, 2], &[2, 3])), Some(false));
        // Indices (3, 0) and (0, 2) both at offset 6.
        assert_eq!(self_overlap(&f32s(&[4, 3], &[2, 3])), Some(true));
        assert_eq!(self_overlap(&f32s(&[4, 3], &[3, 1])), Some(false));
        assert_eq!(self_overlap(&f32s(&[4, 3], &[2, 1])), Some(true));
        assert_eq!(self_overlap(&f32s(&[4, 3], &[0, 1])), Some(true));
        assert_eq!(self_overlap(&f32s(&[2, 3, 2], &[5, 1, 5])), Some(true));
        assert_eq!(self_overlap(&f32s(&[1, 3, 1], &[0, 1, 0])), Some(false));
        // Huge and not nesting: decided, not out of budget, either way.
        assert_eq!(self_overlap(&f32s(&[1 << 20, 2], &[2, 3])), Some(false));
        assert_eq!(self_overlap(&f32s(&[1 << 20, 1 << 20], &[1 << 20, (1 << 20) - 1])), Some(false));
        assert_eq!(self_overlap(&f32s(&[1 << 20, 1 << 20], &[1 << 20, (1 << 20) + 1])), Some(false));
        assert_eq!(self_overlap(&f32s(&[1 << 20, 4], &[1 << 20, 1 << 19])), Some(true));
        assert_eq!(self_overlap(&f32s(&[1 << 20, 1 << 10, 7], &[1 << 20, 1 << 10, 3 << 9])), Some(true));
    }

    proptest! {
        /// Small arrays never exhaust the budget, so the answer is exact.
        #[test]
        fn self_overlap_agrees_with_enumeration(a in small_array()) {
            let elements = a.shape.iter().product::<usize>();
            let distinct = bytes(&a).len() / a.dtype.size();
            prop_assert_eq!(self_overlap(&a), Some(distinct < elements));
        }

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
