//! Typed, strided arrays at raw addresses: the vocabulary the operations
//! plan with and the backends' data-moving primitives read and write.
//!
//! An [`Array`] owns nothing. Its address is in the backend's address space
//! (host virtual or CUDA device virtual), its strides are in elements and
//! never negative. Constructing one from a caller's description is checked
//! by the FFI layer ([`Array::extent_bytes`] must not overflow); every view
//! derived from a checked array here stays inside it.

use crate::fp8::Fp8;

/// Element types. The 8-bit floats are matmul inputs only with scales
/// (see `ops::scaled`), and never converted by copies. The integers are
/// gathered and all-reduced (summed exactly, wrapping), never multiplied
/// or converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    F8E4M3,
    F8E5M2,
    I8,
    U8,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 | DType::U8 => 1,
            DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "fp8_e4m3",
            DType::F8E5M2 => "fp8_e5m2",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }

    /// Whether this is one of the integer types.
    pub fn is_integer(self) -> bool {
        matches!(self, DType::I8 | DType::U8 | DType::I32 | DType::I64)
    }

    /// Whether values convert to and from f32 without scales.
    pub fn is_unscaled_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    /// The 8-bit float format, for the two fp8 types.
    pub fn fp8(self) -> Option<Fp8> {
        match self {
            DType::F8E4M3 => Some(Fp8::E4M3),
            DType::F8E5M2 => Some(Fp8::E5M2),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Array {
    pub addr: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// In elements, one per dimension.
    pub strides: Vec<usize>,
}

impl Array {
    /// A row-major array of `shape` starting at `addr`.
    pub fn contiguous(addr: u64, dtype: DType, shape: &[usize]) -> Array {
        Array { addr, dtype, shape: shape.to_vec(), strides: contiguous_strides(shape) }
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes from `addr` to the end of the last element, or `None` when
    /// that is more than any one object can span (`isize::MAX` bytes, the
    /// limit of pointer offsets) or runs past the end of the address space.
    pub fn extent_bytes(&self) -> Option<u64> {
        let mut last = 0u64;
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let step = (n as u64).checked_sub(1)?.checked_mul(s as u64)?;
            last = last.checked_add(step)?;
        }
        let bytes = last.checked_add(1)?.checked_mul(self.dtype.size() as u64)?;
        if bytes > isize::MAX as u64 {
            return None;
        }
        self.addr.checked_add(bytes).map(|_| bytes)
    }

    /// `[first byte, one past the last byte)` the array touches.
    pub fn byte_range(&self) -> std::ops::Range<u64> {
        let bytes = self.extent_bytes().expect("an array's extent is checked when it is made");
        self.addr..self.addr + bytes
    }

    /// Whether the two arrays may share a byte: their byte ranges
    /// intersect and `overlap::may_share` finds (or cannot rule out) a
    /// common byte, so interleaved arrays that share none do not count.
    pub fn overlaps(&self, other: &Array) -> bool {
        let (a, b) = (self.byte_range(), other.byte_range());
        a.start < b.end && b.start < a.end && crate::overlap::may_share(self, other)
    }

    pub fn is_contiguous(&self) -> bool {
        self.shape.iter().zip(&self.strides).zip(contiguous_strides(&self.shape)).all(|((&n, &s), c)| n == 1 || s == c)
    }

    /// Whether two different indices may address the same element: exact
    /// (`overlap::self_overlap`) but for layouts whose search runs out of
    /// budget, which count as overlapping.
    pub fn self_overlaps(&self) -> bool {
        crate::overlap::self_overlap(self) != Some(false)
    }

    /// The elements `start..start + len` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Array {
        assert!(start + len <= self.shape[dim], "narrow out of bounds");
        let mut a = self.clone();
        a.addr += (start * self.strides[dim] * self.dtype.size()) as u64;
        a.shape[dim] = len;
        a
    }

    /// The same elements as a `[rows, last dim]` matrix that a BLAS reads:
    /// row-major (unit column stride, rows at least a row apart) or
    /// column-major. `None` when the leading dimensions do not collapse into
    /// rows of one stride (e.g. a slice in the middle of a row-major array),
    /// or when neither layout holds (both strides over one, or rows that
    /// overlap, as a broadcast's stride 0): such arrays are packed first.
    /// A dimension of one element gets the stride that makes the matrix
    /// row-major where it can.
    pub fn as_matrix(&self) -> Option<Array> {
        let (&cols, lead) = self.shape.split_last()?;
        let (rows, row_stride) = collapse(lead, &self.strides[..lead.len()])?;
        let mut col_stride = *self.strides.last()?;
        if cols == 1 {
            col_stride = 1;
        }
        let row_stride = match row_stride {
            Some(s) => s,
            None if col_stride == 1 => cols,
            None => 1, // one row: column-major with its column stride as the leading dimension
        };
        let row_major = col_stride == 1 && row_stride >= cols;
        let column_major = row_stride == 1 && col_stride >= rows && col_stride > 0;
        (row_major || column_major).then(|| Array {
            addr: self.addr,
            dtype: self.dtype,
            shape: vec![rows, cols],
            strides: vec![row_stride, col_stride],
        })
    }

    /// [`Self::as_matrix`] where it is row-major: what a matmul writes
    /// (cuBLASLt's C, the fused kernel's tiles).
    pub fn as_row_major_matrix(&self) -> Option<Array> {
        self.as_matrix().filter(|m| m.strides[1] == 1)
    }

    /// The same elements as a batch of equally strided matrices, `[batch,
    /// rows, last dim]`: dimensions `..split` collapse into the batch (one
    /// stride) and `split..` into matrices (as [`Self::as_matrix`]); `None`
    /// when either part does not collapse, or `split` leaves no room for
    /// rows (`1 <= split < ndim - 1`). E.g. a slice along the middle
    /// dimension of a row-major `[b, s, n]`, which is no matrix.
    pub fn as_batched(&self, split: usize) -> Option<Array> {
        if split == 0 || split + 1 >= self.ndim() {
            return None;
        }
        let (batch, batch_stride) = collapse(&self.shape[..split], &self.strides[..split])?;
        let m = Array { shape: self.shape[split..].to_vec(), strides: self.strides[split..].to_vec(), ..self.clone() };
        let m = m.as_matrix()?;
        // One matrix: its stride is never used; that of the next one after it.
        let batch_stride = batch_stride.unwrap_or(m.shape[0] * m.strides[0]);
        Some(Array {
            addr: self.addr,
            dtype: self.dtype,
            shape: vec![batch, m.shape[0], m.shape[1]],
            strides: vec![batch_stride, m.strides[0], m.strides[1]],
        })
    }
}

/// Dimensions of `shape` (with `strides`) as one: (elements, stride),
/// when each dimension of more than one element steps over all those
/// inside it (stride `None` when there is no such dimension); `None` when
/// they do not collapse.
fn collapse(shape: &[usize], strides: &[usize]) -> Option<(usize, Option<usize>)> {
    let mut count = 1usize;
    let mut stride: Option<usize> = None;
    for (&n, &s) in shape.iter().zip(strides).rev().filter(|&(&n, _)| n > 1) {
        match stride {
            None => stride = Some(s),
            Some(inner) if s == inner * count => {}
            Some(_) => return None,
        }
        count *= n;
    }
    Some((count, stride))
}

pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(shape: &[usize], strides: &[usize]) -> Array {
        Array { addr: 4096, dtype: DType::BF16, shape: shape.to_vec(), strides: strides.to_vec() }
    }

    #[test]
    fn contiguous_strides_and_extent() {
        let a = Array::contiguous(4096, DType::F32, &[2, 3, 4]);
        assert_eq!(a.strides, vec![12, 4, 1]);
        assert!(a.is_contiguous());
        assert_eq!(a.extent_bytes(), Some(96));
        assert_eq!(a.byte_range(), 4096..4192);
        assert_eq!(arr(&[2, 3], &[1, 2]).extent_bytes(), Some(12));
        assert_eq!(Array { addr: u64::MAX - 2, ..arr(&[2], &[1]) }.extent_bytes(), None);
        assert_eq!(arr(&[3, usize::MAX], &[usize::MAX, 1]).extent_bytes(), None);
        // Between 2^63 and 2^64 bytes: fits a u64, but no object is that large.
        assert_eq!(arr(&[2, 8], &[1 << 62, 1]).extent_bytes(), None);
        assert_eq!(arr(&[2, 8], &[1 << 61, 1]).extent_bytes(), Some((1 << 62) + 16));
    }

    #[test]
    fn narrow_moves_address_and_breaks_contiguity() {
        let a = arr(&[4, 6, 8], &[48, 8, 1]);
        let n = a.narrow(1, 2, 3);
        assert_eq!(n.addr, 4096 + 2 * 8 * 2);
        assert_eq!(n.shape, vec![4, 3, 8]);
        assert!(!n.is_contiguous());
        assert!(a.narrow(0, 1, 2).is_contiguous());
    }

    #[test]
    fn batched_views() {
        // A slice along the middle of [4, 6, 8]: 4 matrices of 3 x 8, 48 apart.
        let s = arr(&[4, 6, 8], &[48, 8, 1]).narrow(1, 2, 3);
        assert!(s.as_matrix().is_none());
        let b = s.as_batched(1).unwrap();
        assert_eq!((b.addr, b.shape, b.strides), (s.addr, vec![4, 3, 8], vec![48, 8, 1]));
        // Four dimensions: the batch or the rows may span several.
        let s = arr(&[2, 5, 6, 8], &[240, 48, 8, 1]).narrow(2, 1, 3);
        let b = s.as_batched(2).unwrap();
        assert_eq!((b.shape, b.strides), (vec![10, 3, 8], vec![48, 8, 1]));
        assert!(s.as_batched(1).is_none(), "rows [5, 3] of strides [48, 8] do not collapse");
        let s = arr(&[2, 5, 6, 8], &[240, 48, 8, 1]).narrow(1, 1, 3);
        let b = s.as_batched(1).unwrap();
        assert_eq!((b.shape, b.strides), (vec![2, 18, 8], vec![240, 8, 1]));
        // Padded rows and a column-major matrix inside each batch.
        let b = arr(&[3, 4, 5], &[100, 1, 7]).as_batched(1).unwrap();
        assert_eq!((b.shape, b.strides), (vec![3, 4, 5], vec![100, 1, 7]));
        // A batch of one: the stride steps past the matrix.
        let b = arr(&[1, 4, 5], &[0, 5, 1]).as_batched(1).unwrap();
        assert_eq!((b.shape, b.strides), (vec![1, 4, 5], vec![20, 5, 1]));
        // No rows left to split off, or nothing to batch.
        assert!(arr(&[4, 8], &[8, 1]).as_batched(1).is_none());
        assert!(arr(&[4, 6, 8], &[48, 8, 1]).as_batched(0).is_none());
        assert!(arr(&[4, 6, 8], &[48, 8, 1]).as_batched(2).is_none());
    }

    #[test]
    fn matrix_views() {
        // Leading dims of a row-major array collapse.
        let m = arr(&[2, 3, 5], &[15, 5, 1]).as_matrix().unwrap();
        assert_eq!((m.shape, m.strides), (vec![6, 5], vec![5, 1]));
        // A column-major 2-D array is a matrix with its own strides.
        let t = arr(&[4, 3], &[1, 4]).as_matrix().unwrap();
        assert_eq!((t.shape, t.strides), (vec![4, 3], vec![1, 4]));
        // A slice along a middle dimension does not collapse ...
        assert!(arr(&[4, 6, 8], &[48, 8, 1]).narrow(1, 0, 3).as_matrix().is_none());
        // ... unless the outer dimension is 1.
        let m = arr(&[1, 6, 8], &[48, 8, 1]).narrow(1, 2, 3).as_matrix().unwrap();
        assert_eq!((m.shape, m.strides), (vec![3, 8], vec![8, 1]));
        // Rows of one element take the natural row stride.
        let m = arr(&[1, 1, 7], &[7, 7, 1]).as_matrix().unwrap();
        assert_eq!((m.shape, m.strides), (vec![1, 7], vec![7, 1]));
    }

    /// Only layouts a BLAS reads are matrices; the rest are packed by the
    /// operations (the CUDA backend's matmul would reject them).
    #[test]
    fn matrices_are_row_or_column_major() {
        // Every other column: neither stride is one.
        assert!(arr(&[4, 3], &[6, 2]).as_matrix().is_none());
        // A broadcast row (stride 0) or rows closer than a row apart overlap.
        assert!(arr(&[4, 3], &[0, 1]).as_matrix().is_none());
        assert!(arr(&[4, 3], &[2, 1]).as_matrix().is_none());
        assert!(arr(&[4, 3], &[1, 2]).as_matrix().is_none());
        // Padded rows and padded columns are fine.
        assert_eq!(arr(&[4, 3], &[5, 1]).as_matrix().unwrap().strides, vec![5, 1]);
        assert_eq!(arr(&[4, 3], &[1, 6]).as_matrix().unwrap().strides, vec![1, 6]);
        // One column: any stride between its rows, read row-major.
        let m = arr(&[4, 1], &[3, 2]).as_matrix().unwrap();
        assert_eq!(m.strides, vec![3, 1]);
        assert!(arr(&[4, 1], &[0, 1]).as_matrix().is_none(), "a broadcast column");
        // One row: any column stride but 0, read column-major.
        assert_eq!(arr(&[1, 5], &[9, 3]).as_matrix().unwrap().strides, vec![1, 3]);
        assert!(arr(&[1, 5], &[9, 0]).as_matrix().is_none());
        // What a matmul writes: row-major only.
        assert!(arr(&[4, 3], &[1, 4]).as_row_major_matrix().is_none());
        assert!(arr(&[4, 3], &[3, 1]).as_row_major_matrix().is_some());
    }

    #[test]
    fn overlap_tests() {
        assert!(!arr(&[3, 4], &[4, 1]).self_overlaps());
        assert!(!arr(&[3, 4], &[1, 3]).self_overlaps());
        assert!(!arr(&[3, 4], &[10, 2]).self_overlaps());
        assert!(arr(&[3, 4], &[0, 1]).self_overlaps());
        assert!(arr(&[3, 4], &[2, 1]).self_overlaps());
        assert!(!arr(&[1, 4], &[0, 1]).self_overlaps());
        // Strides that do not nest, elements distinct (offsets 0, 3, 2, 5, 4, 7).
        assert!(!arr(&[3, 2], &[2, 3]).self_overlaps());
        let a = arr(&[4], &[1]);
        let b = Array { addr: 4096 + 6, ..arr(&[4], &[1]) };
        let c = Array { addr: 4096 + 8, ..arr(&[4], &[1]) };
        assert!(a.overlaps(&b) && b.overlaps(&a));
        assert!(!a.overlaps(&c));
        // Interleaved columns share no element.
        let even = arr(&[4, 4], &[8, 2]);
        let odd = Array { addr: 4096 + 2, ..even.clone() };
        assert!(!even.overlaps(&odd) && !odd.overlaps(&even));
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// The extent by wide arithmetic: each step fits in 128 bits, and a
        /// sum past them is past `isize::MAX` anyway.
        fn reference_extent(a: &Array) -> Option<u64> {
            let mut steps = a.shape.iter().zip(&a.strides).map(|(&n, &s)| (n as u128 - 1) * s as u128);
            let last = steps.try_fold(0u128, u128::checked_add)?;
            let bytes = (last + 1).checked_mul(a.dtype.size() as u128)?;
            (bytes <= isize::MAX as u128 && a.addr as u128 + bytes <= u64::MAX as u128).then_some(bytes as u64)
        }

        /// The last byte by enumerating every element (small arrays).
        fn enumerated_extent(a: &Array) -> u64 {
            let mut idx = vec![0usize; a.ndim()];
            let mut last = 0;
            loop {
                let off: usize = idx.iter().zip(&a.strides).map(|(i, s)| i * s).sum();
                last = last.max((off + 1) * a.dtype.size());
                let mut d = a.ndim();
                loop {
                    if d == 0 {
                        return last as u64;
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

        fn dtype() -> impl Strategy<Value = DType> {
            prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F8E5M2), Just(DType::I64)]
        }

        /// Any size: shapes and strides up to 2^64, including the 2^63..2^64 band.
        fn any_array() -> impl Strategy<Value = Array> {
            let size = prop_oneof![1usize..4, any::<usize>(), (0u32..64).prop_map(|b| 1usize << b)];
            let dims = prop::collection::vec((size.clone(), size), 1..5);
            (any::<u64>(), dtype(), dims).prop_map(|(addr, dtype, dims)| {
                let (shape, strides): (Vec<usize>, Vec<usize>) = dims.into_iter().map(|(n, s)| (n.max(1), s)).unzip();
                Array { addr: addr & !7, dtype, shape, strides }
            })
        }

        proptest! {
            #[test]
            fn extent_matches_wide_arithmetic(a in any_array()) {
                prop_assert_eq!(a.extent_bytes(), reference_extent(&a));
            }

            #[test]
            fn extent_matches_enumeration(
                dtype in dtype(),
                dims in prop::collection::vec((1usize..5, 0usize..9), 1..4),
            ) {
                let (shape, strides) = dims.into_iter().unzip();
                let a = Array { addr: 4096, dtype, shape, strides };
                prop_assert_eq!(a.extent_bytes(), Some(enumerated_extent(&a)));
            }

            /// The self-overlap test is exact: an array it passes never
            /// reaches one element by two indices, and one it refuses does.
            #[test]
            fn self_overlap_is_exact(dims in prop::collection::vec((1usize..4, 0usize..9), 1..4)) {
                let (shape, strides) = dims.into_iter().unzip();
                let a = Array { addr: 4096, dtype: DType::F32, shape, strides };
                let mut seen = std::collections::HashSet::new();
                let mut idx = vec![0usize; a.ndim()];
                let mut repeats = false;
                'all: loop {
                    let off: usize = idx.iter().zip(&a.strides).map(|(i, s)| i * s).sum();
                    repeats |= !seen.insert(off);
                    let mut d = a.ndim();
                    loop {
                        if d == 0 {
                            break 'all;
                        }
                        d -= 1;
                        idx[d] += 1;
                        if idx[d] < a.shape[d] {
                            break;
                        }
                        idx[d] = 0;
                    }
                }
                prop_assert_eq!(a.self_overlaps(), repeats);
            }
        }
    }
}
