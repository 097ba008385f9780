//! Argument checks shared by the operations. Each names the argument as
//! the C caller wrote it and says what was expected. None of them touches
//! memory: they run before anything is written.

use crate::array::{Array, DType};
use crate::error::{err, Result};

/// The tensor has at least `min` dimensions.
pub fn ndim_at_least(t: &Array, name: &str, min: usize) -> Result<()> {
    if t.ndim() < min {
        return Err(err!(InvalidArgument, "{name}.ndim is {}; expected at least {min}", t.ndim()));
    }
    Ok(())
}

pub fn ndim_is(t: &Array, name: &str, want: usize) -> Result<()> {
    if t.ndim() != want {
        return Err(err!(InvalidArgument, "{name}.ndim is {}; expected {want}", t.ndim()));
    }
    Ok(())
}

/// An input of the same type as `of`.
pub fn same_dtype(t: &Array, name: &str, want: DType, of: &str) -> Result<()> {
    if t.dtype != want {
        return Err(err!(InvalidArgument, "{name}.dtype is {}; expected {want}, the dtype of {of}", t.dtype));
    }
    Ok(())
}

/// A matmul output: its type is the inputs' (another output type is a
/// later addition, hence Unsupported rather than invalid).
pub fn output_dtype(t: &Array, name: &str, want: DType, backend: &str) -> Result<()> {
    matmul_input(t.dtype, &format!("{name}.dtype"))?;
    if t.dtype != want {
        return Err(err!(
            Unsupported,
            "{name}.dtype is {} but the inputs are {want}; an output dtype other than the inputs' is not \
             supported by the {backend} backend yet",
            t.dtype
        ));
    }
    Ok(())
}

/// A matmul operand's type: integers are gathered and all-reduced, never
/// multiplied.
pub fn matmul_input(dtype: DType, name: &str) -> Result<()> {
    if dtype.is_integer() {
        return Err(err!(
            InvalidArgument,
            "{name} is {dtype}; matmuls take f32, bf16, f16 or fp8 operands (integers are supported by \
             symm_lc_allgather and symm_all_reduce only)"
        ));
    }
    Ok(())
}

/// A matmul's B (2-D): row-major or column-major, as a BLAS reads it (a
/// Linear weight or its transpose, padded or not). Checked on every
/// backend, so that a call that runs on the host backend runs on CUDA.
pub fn matmul_operand(b: &Array, name: &str) -> Result<()> {
    if b.as_matrix().is_none() {
        return Err(err!(
            Unsupported,
            "{name} has shape {:?} and strides {:?}; a matmul's B must be row-major or column-major (unit \
             stride along one dimension, its rows or columns not overlapping, e.g. a weight or its \
             transpose); pass a contiguous copy",
            b.shape,
            b.strides
        ));
    }
    Ok(())
}

/// A gather/scatter dimension of a `ndim`-dimensional tensor named `of`.
pub fn dim(value: i64, name: &str, ndim: usize, of: &str) -> Result<usize> {
    match usize::try_from(value) {
        Ok(d) if d < ndim => Ok(d),
        _ => Err(err!(InvalidArgument, "{name} is {value}; expected 0..{} ({of} has {ndim} dimensions)", ndim - 1)),
    }
}

pub fn shape_is(t: &Array, name: &str, want: &[usize]) -> Result<()> {
    if t.shape != want {
        return Err(err!(InvalidArgument, "{name}.shape is {:?}; expected {want:?}", t.shape));
    }
    Ok(())
}

/// Outputs are written element by element, so no two of an output's
/// elements may share memory, and no output may share memory with an
/// input or another output (they would be read after being written).
pub fn outputs_disjoint(outputs: &[(String, &Array)], inputs: &[(String, &Array)]) -> Result<()> {
    for (i, (name, out)) in outputs.iter().enumerate() {
        let why = match crate::overlap::self_overlap(out) {
            Some(false) => None,
            Some(true) => Some("so its elements overlap"),
            None => Some("and symm cannot show its elements are distinct (too many to search)"),
        };
        if let Some(why) = why {
            return Err(err!(
                InvalidArgument,
                "{name} has strides {:?} for shape {:?}, {why}; expected non-overlapping strides",
                out.strides,
                out.shape
            ));
        }
        let others = inputs.iter().chain(&outputs[..i]);
        if let Some((other, _)) = others.into_iter().find(|(_, t)| out.overlaps(t)) {
            return Err(err!(InvalidArgument, "{name} overlaps {other} in memory; expected separate memory"));
        }
    }
    Ok(())
}

/// `a * b`, or an error naming what would not fit.
pub fn mul(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| err!(InvalidArgument, "{what} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn t(addr: u64, shape: &[usize]) -> Array {
        Array::contiguous(addr, DType::BF16, shape)
    }

    #[test]
    fn messages_name_argument_and_expectation() {
        let e = ndim_at_least(&t(0x1000, &[4]), "a_shard", 2).unwrap_err();
        assert_eq!(e.msg, "a_shard.ndim is 1; expected at least 2");
        let e = dim(3, "gather_dim", 3, "a_shard").unwrap_err();
        assert_eq!(e.msg, "gather_dim is 3; expected 0..2 (a_shard has 3 dimensions)");
        assert_eq!(dim(-1, "gather_dim", 3, "a_shard").unwrap_err().kind, ErrorKind::InvalidArgument);
        assert_eq!(dim(2, "gather_dim", 3, "a_shard").unwrap(), 2);
        let e = shape_is(&t(0x1000, &[8, 3]), "outs[1]", &[8, 5]).unwrap_err();
        assert_eq!(e.msg, "outs[1].shape is [8, 3]; expected [8, 5]");
        let e = same_dtype(&Array::contiguous(0x1000, DType::F16, &[2]), "bs[0]", DType::BF16, "a_shard").unwrap_err();
        assert_eq!(e.msg, "bs[0].dtype is f16; expected bf16, the dtype of a_shard");
    }

    #[test]
    fn other_output_dtypes_are_unsupported() {
        let f32_out = Array::contiguous(0x1000, DType::F32, &[2, 2]);
        assert_eq!(output_dtype(&f32_out, "out", DType::BF16, "host").unwrap_err().kind, ErrorKind::Unsupported);
    }

    /// A B no BLAS reads is refused on every backend, by name; a weight,
    /// its transpose and padded rows are not.
    #[test]
    fn b_is_row_or_column_major() {
        let b = |strides: &[usize]| Array { strides: strides.to_vec(), ..t(0x1000, &[4, 3]) };
        for ok in [&[3, 1][..], &[1, 4], &[8, 1], &[1, 6]] {
            assert!(matmul_operand(&b(ok), "b").is_ok(), "{ok:?}");
        }
        for bad in [&[6, 2][..], &[0, 1], &[1, 0], &[2, 1]] {
            let e = matmul_operand(&b(bad), "bs[1]").unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unsupported);
            assert!(e.msg.starts_with("bs[1] has shape [4, 3] and strides"), "{}", e.msg);
        }
    }

    #[test]
    fn overlapping_outputs_are_rejected() {
        let a = t(0x1000, &[4, 4]); // 32 bytes
        let out = |addr| (String::from("out"), t(addr, &[2, 4]));
        let (name, o) = out(0x1010);
        let e = outputs_disjoint(&[(name, &o)], &[("a".into(), &a)]).unwrap_err();
        assert_eq!(e.msg, "out overlaps a in memory; expected separate memory");
        let (name, o) = out(0x1020);
        assert!(outputs_disjoint(&[(name.clone(), &o)], &[("a".into(), &a)]).is_ok());
        let e = outputs_disjoint(&[(name.clone(), &o), ("out2".into(), &o)], &[]).unwrap_err();
        assert_eq!(e.msg, "out2 overlaps out in memory; expected separate memory");
        // Interleaved columns of one allocation share no element.
        let even = Array { strides: vec![8, 2], ..t(0x3000, &[4, 4]) };
        let odd = Array { addr: 0x3002, ..even.clone() };
        assert!(outputs_disjoint(&[("outs[0]".into(), &even), ("outs[1]".into(), &odd)], &[]).is_ok());
        let bad = Array { strides: vec![1, 1], ..t(0x2000, &[2, 4]) };
        let e = outputs_disjoint(&[("out".into(), &bad)], &[]).unwrap_err();
        assert!(e.msg.contains("overlap"), "{}", e.msg);
    }

    /// Strides that do not nest but reach every element once are accepted;
    /// where the search gives up, the message does not claim an overlap.
    #[test]
    fn self_overlap_is_decided_exactly() {
        let distinct = Array { strides: vec![2, 3], ..Array::contiguous(0x1000, DType::F32, &[3, 2]) };
        assert!(outputs_disjoint(&[("output".into(), &distinct)], &[]).is_ok());
        let e = outputs_disjoint(&[("output".into(), &Array { strides: vec![2, 3], ..t(0x1000, &[4, 3]) })], &[])
            .unwrap_err();
        assert!(e.msg.contains("so its elements overlap"), "{}", e.msg);
        let strides = vec![4099, 4093, 4091, 4079, 4073, 4057, 4051, 4049];
        let unknown = Array { strides, ..t(0x1000, &[64; 8]) };
        assert_eq!(crate::overlap::self_overlap(&unknown), None, "the search no longer gives up here");
        let e = outputs_disjoint(&[("output".into(), &unknown)], &[]).unwrap_err();
        assert!(e.msg.contains("symm cannot show its elements are distinct"), "{}", e.msg);
    }
}
