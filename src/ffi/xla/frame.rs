//! Reading an XLA FFI call frame: the metadata request, the execution
//! stage, buffers (as symm arrays) and attributes, each checked before use.
//! Nothing here trusts a count, pointer or struct size it has not checked.

use super::api::Api;
use super::c_api::*;
use crate::array::Array;
use crate::error::{err, Result};
use crate::ffi::types::*;
use std::ffi::c_void;

/// The handler traits we announce: none. In particular not
/// `COMMAND_BUFFER_COMPATIBLE`: a call may grow the group's workspace (a
/// rendezvous, impossible during capture), and a later, larger call
/// replaces the workspace and frees the old one, which a recorded command
/// buffer would still point to. Replays would then be incorrect.
pub const TRAITS: XLA_FFI_Handler_Traits = 0;

/// What XLA asks of a handler.
pub enum Request<'a> {
    /// Registration-time handshake: report our API version and traits.
    Metadata(&'a mut XLA_FFI_Metadata),
    /// A call at `stage` (we only serve `EXECUTE`).
    Call(Frame<'a>),
}

/// A checked call frame.
pub struct Frame<'a> {
    pub api: Api<'a>,
    raw: &'a XLA_FFI_CallFrame,
}

/// Checks the frame's struct sizes and the API version, and tells a
/// metadata request from a call.
///
/// # Safety
/// `frame` is the pointer XLA passed to the handler, whose `api` was found
/// valid by [`api_of`].
pub unsafe fn open<'a>(frame: *mut XLA_FFI_CallFrame, api: Api<'a>) -> Result<Request<'a>> {
    // SAFETY: checked non-NULL by `api_of`; XLA keeps it alive for the call.
    let raw: &'a XLA_FFI_CallFrame = unsafe { &*frame };
    if raw.struct_size < XLA_FFI_CallFrame_STRUCT_SIZE as usize {
        return Err(err!(
            Unsupported,
            "XLA_FFI_CallFrame is {} bytes; expected at least {} (check the installed jaxlib)",
            raw.struct_size,
            XLA_FFI_CallFrame_STRUCT_SIZE
        ));
    }
    api.check_version()?;
    let ext = raw.extension_start;
    // SAFETY: a non-NULL extension chain is XLA's, alive for the call.
    if !ext.is_null() && unsafe { (*ext).type_ } == XLA_FFI_Extension_Metadata {
        // SAFETY: an extension of the metadata type is a metadata extension.
        let ext = unsafe { &*(ext as *const XLA_FFI_Metadata_Extension) };
        if ext.extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE as usize || ext.metadata.is_null() {
            return Err(err!(InvalidArgument, "malformed XLA_FFI_Metadata_Extension"));
        }
        // SAFETY: non-NULL, XLA's, and written only here.
        let md = unsafe { &mut *ext.metadata };
        if md.struct_size < XLA_FFI_Metadata_STRUCT_SIZE as usize {
            return Err(err!(
                Unsupported,
                "XLA_FFI_Metadata is {} bytes; expected at least {}",
                md.struct_size,
                XLA_FFI_Metadata_STRUCT_SIZE
            ));
        }
        return Ok(Request::Metadata(md));
    }
    Ok(Request::Call(Frame { api, raw }))
}

/// The API table of a frame, if the frame and table can be read at all
/// (otherwise there is no way to report an error to XLA).
///
/// # Safety
/// `frame` is NULL or the pointer XLA passed to the handler.
pub unsafe fn api_of<'a>(frame: *mut XLA_FFI_CallFrame) -> Option<Api<'a>> {
    // SAFETY: per the contract; XLA keeps frame and table alive for the call.
    let raw = unsafe { frame.as_ref() }?;
    if raw.struct_size < std::mem::offset_of!(XLA_FFI_CallFrame, ctx) {
        return None;
    }
    // SAFETY: as above.
    let api = unsafe { raw.api.as_ref() }?;
    (api.struct_size >= std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Error_GetMessage)).then_some(Api(api))
}

/// Answers the handshake: the API version of our header and our traits.
pub fn fill_metadata(md: &mut XLA_FFI_Metadata) {
    md.api_version = XLA_FFI_Api_Version {
        struct_size: XLA_FFI_Api_Version_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        major_version: XLA_FFI_API_MAJOR as i32,
        minor_version: XLA_FFI_API_MINOR as i32,
    };
    md.traits = TRAITS;
    // A newer XLA's struct has the state type (ours: none, stateless).
    if md.struct_size >= std::mem::size_of::<XLA_FFI_Metadata>() {
        md.state_type_id = XLA_FFI_TypeId { type_id: 0 };
    }
}

/// One attribute's value, as far as the handlers use attributes.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Str(String),
    /// An array of 64-bit integers.
    Ints(Vec<i64>),
    /// Present but of a type no handler takes (arrays, dictionaries,
    /// floats...): named in the error when it is looked up.
    Other(&'static str),
}

/// A call's attributes by name; each must be taken exactly once, so that a
/// misspelt or extra attribute is an error rather than silently ignored.
#[derive(Debug)]
pub struct Attrs {
    items: Vec<(String, Attr)>,
}

impl Attrs {
    fn take(&mut self, name: &str) -> Result<Attr> {
        let i = self
            .items
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| err!(InvalidArgument, "attribute {name} is missing"))?;
        Ok(self.items.remove(i).1)
    }

    pub fn int(&mut self, name: &str) -> Result<i64> {
        match self.take(name)? {
            Attr::Int(v) => Ok(v),
            other => Err(err!(InvalidArgument, "attribute {name} is {other:?}; expected an integer")),
        }
    }

    pub fn string(&mut self, name: &str) -> Result<String> {
        match self.take(name)? {
            Attr::Str(s) => Ok(s),
            other => Err(err!(InvalidArgument, "attribute {name} is {other:?}; expected a string")),
        }
    }

    /// The integer array `name`, or None when it is absent.
    pub fn optional_ints(&mut self, name: &str) -> Result<Option<Vec<i64>>> {
        if !self.items.iter().any(|(n, _)| n == name) {
            return Ok(None);
        }
        match self.take(name)? {
            Attr::Ints(v) => Ok(Some(v)),
            other => Err(err!(InvalidArgument, "attribute {name} is {other:?}; expected an array of int64")),
        }
    }

    /// Fails when attributes are left that no one took.
    pub fn finish(self) -> Result<()> {
        if self.items.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = self.items.iter().map(|(n, _)| n.as_str()).collect();
        Err(err!(InvalidArgument, "unexpected attributes: {}", names.join(", ")))
    }
}

impl<'a> Frame<'a> {
    pub fn stage(&self) -> XLA_FFI_ExecutionStage {
        self.raw.stage
    }

    pub fn ctx(&self) -> *mut XLA_FFI_ExecutionContext {
        self.raw.ctx
    }

    /// The argument buffers, as symm arrays named `name[i]` in messages.
    pub fn args(&self) -> Result<Vec<XlaBuffer<'a>>> {
        let a = &self.raw.args;
        check_list(a.struct_size, XLA_FFI_Args_STRUCT_SIZE, a.size, "arguments")?;
        // SAFETY: XLA passes `size` types and pointers (checked non-negative).
        let (types, ptrs) = unsafe { (slice(a.types, a.size)?, slice(a.args, a.size)?) };
        buffers(types, ptrs, XLA_FFI_ArgType_BUFFER, "argument")
    }

    /// The result buffers.
    pub fn rets(&self) -> Result<Vec<XlaBuffer<'a>>> {
        let r = &self.raw.rets;
        check_list(r.struct_size, XLA_FFI_Rets_STRUCT_SIZE, r.size, "results")?;
        // SAFETY: as in `args`.
        let (types, ptrs) = unsafe { (slice(r.types, r.size)?, slice(r.rets, r.size)?) };
        buffers(types, ptrs, XLA_FFI_RetType_BUFFER, "result")
    }

    pub fn attrs(&self) -> Result<Attrs> {
        let a = &self.raw.attrs;
        check_list(a.struct_size, XLA_FFI_Attrs_STRUCT_SIZE, a.size, "attributes")?;
        // SAFETY: XLA passes `size` types, names and values.
        let (types, names, values) =
            unsafe { (slice(a.types, a.size)?, slice(a.names, a.size)?, slice(a.attrs, a.size)?) };
        let mut items = Vec::with_capacity(types.len());
        for ((&ty, &name), &value) in types.iter().zip(names).zip(values) {
            // SAFETY: each name is a span XLA keeps alive for the call.
            let name = unsafe { name.as_ref() }.ok_or_else(|| err!(InvalidArgument, "an attribute has no name"))?;
            // SAFETY: the span's bytes, per XLA.
            let name = unsafe { span_text(name) }?;
            // SAFETY: `value` points to the C struct `ty` names.
            let attr = unsafe { attr_value(ty, value) }.map_err(|e| e.context(format!("attribute {name}")))?;
            items.push((name, attr));
        }
        Ok(Attrs { items })
    }
}

fn check_list(struct_size: usize, expected: u32, size: i64, what: &str) -> Result<()> {
    if struct_size < expected as usize {
        return Err(err!(Unsupported, "the {what} struct is {struct_size} bytes; expected at least {expected}"));
    }
    if size < 0 {
        return Err(err!(InvalidArgument, "{size} {what}"));
    }
    Ok(())
}

/// # Safety
/// `p` is NULL (allowed when `n` is 0) or points to `n` values.
unsafe fn slice<'a, T>(p: *const T, n: i64) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(err!(InvalidArgument, "a list of {n} entries is NULL"));
    }
    // SAFETY: per the contract; `n` is positive and came from XLA.
    Ok(unsafe { std::slice::from_raw_parts(p, n as usize) })
}

/// # Safety
/// The span's pointer and length describe readable bytes.
unsafe fn span_text(s: &XLA_FFI_ByteSpan) -> Result<String> {
    // SAFETY: per the contract.
    let bytes = unsafe { slice(s.ptr as *const u8, s.len as i64) }?;
    String::from_utf8(bytes.to_vec()).map_err(|_| err!(InvalidArgument, "a string attribute is not UTF-8"))
}

/// # Safety
/// `value` points to the struct XLA passes for attributes of type `ty`.
unsafe fn attr_value(ty: XLA_FFI_AttrType, value: *mut c_void) -> Result<Attr> {
    if value.is_null() {
        return Err(err!(InvalidArgument, "has no value"));
    }
    match ty {
        XLA_FFI_AttrType_SCALAR => {
            // SAFETY: scalars are passed as `XLA_FFI_Scalar`.
            let s = unsafe { &*(value as *const XLA_FFI_Scalar) };
            if s.value.is_null() {
                return Err(err!(InvalidArgument, "has no value"));
            }
            // SAFETY: the value has the scalar's dtype.
            Ok(match s.dtype {
                XLA_FFI_DataType_S64 => Attr::Int(unsafe { *(s.value as *const i64) }),
                XLA_FFI_DataType_S32 => Attr::Int(unsafe { *(s.value as *const i32) }.into()),
                XLA_FFI_DataType_PRED => Attr::Int(unsafe { *(s.value as *const u8) }.into()),
                _ => Attr::Other("a non-integer scalar"),
            })
        }
        // SAFETY: strings are passed as `XLA_FFI_ByteSpan`.
        XLA_FFI_AttrType_STRING => Ok(Attr::Str(unsafe { span_text(&*(value as *const XLA_FFI_ByteSpan)) }?)),
        XLA_FFI_AttrType_ARRAY => {
            // SAFETY: arrays are passed as `XLA_FFI_Array`.
            let a = unsafe { &*(value as *const XLA_FFI_Array) };
            if a.dtype != XLA_FFI_DataType_S64 {
                return Ok(Attr::Other("an array of other than int64"));
            }
            let n = i64::try_from(a.size).map_err(|_| err!(InvalidArgument, "has {} elements", a.size))?;
            // SAFETY: XLA passes `size` values of the array's dtype.
            Ok(Attr::Ints(unsafe { slice(a.data as *const i64, n) }?.to_vec()))
        }
        XLA_FFI_AttrType_DICTIONARY => Ok(Attr::Other("a dictionary")),
        _ => Ok(Attr::Other("of an unknown type")),
    }
}

/// A buffer XLA passed, not yet read.
pub struct XlaBuffer<'a>(&'a XLA_FFI_Buffer);

fn buffers<'a>(types: &[u32], ptrs: &[*mut c_void], want: u32, what: &str) -> Result<Vec<XlaBuffer<'a>>> {
    let mut out = Vec::with_capacity(ptrs.len());
    for (i, (&ty, &p)) in types.iter().zip(ptrs).enumerate() {
        if ty != want {
            return Err(err!(InvalidArgument, "{what} {i} is not a buffer; symm takes arrays only"));
        }
        // SAFETY: buffer arguments and results are `XLA_FFI_Buffer`s XLA
        // keeps alive for the call.
        let b = unsafe { (p as *const XLA_FFI_Buffer).as_ref() }
            .ok_or_else(|| err!(InvalidArgument, "{what} {i} is NULL"))?;
        if b.struct_size < XLA_FFI_Buffer_STRUCT_SIZE as usize {
            return Err(err!(Unsupported, "{what} {i}: XLA_FFI_Buffer is {} bytes", b.struct_size));
        }
        // A token only orders the call (symm.jax threads one through each
        // call on XLA's CPU platform); it holds no data.
        if b.dtype != XLA_FFI_DataType_TOKEN {
            out.push(XlaBuffer(b));
        }
    }
    Ok(out)
}

impl XlaBuffer<'_> {
    /// The buffer as a row-major symm array (XLA's default layout, which
    /// `jax.ffi.ffi_call` asks for), checked as the C API checks tensors.
    pub fn array(&self, name: &str) -> Result<Array> {
        let b = self.0;
        let rank = usize::try_from(b.rank)
            .ok()
            .filter(|&r| (1..=SYMM_MAX_DIMS).contains(&r))
            .ok_or_else(|| err!(InvalidArgument, "{name} has {} dimensions; expected 1 to {SYMM_MAX_DIMS}", b.rank))?;
        // SAFETY: XLA passes `rank` dimensions.
        let dims = unsafe { slice(b.dims, b.rank) }?;
        let mut t = symm_tensor_t {
            data: b.data,
            dtype: dtype(b.dtype, name)?,
            ndim: rank as i32,
            shape: [1; SYMM_MAX_DIMS],
            strides: [0; SYMM_MAX_DIMS],
        };
        t.shape[..rank].copy_from_slice(dims);
        let mut stride = 1i64;
        for i in (0..rank).rev() {
            t.strides[i] = stride;
            stride = stride.saturating_mul(dims[i].max(1));
        }
        crate::ffi::args::tensor(&t, &name)
    }
}

fn dtype(d: XLA_FFI_DataType, name: &str) -> Result<symm_dtype_t> {
    Ok(match d {
        XLA_FFI_DataType_F32 => SYMM_DTYPE_F32,
        XLA_FFI_DataType_BF16 => SYMM_DTYPE_BF16,
        XLA_FFI_DataType_F16 => SYMM_DTYPE_F16,
        XLA_FFI_DataType_F8E4M3FN => SYMM_DTYPE_FP8_E4M3,
        XLA_FFI_DataType_F8E5M2 => SYMM_DTYPE_FP8_E5M2,
        XLA_FFI_DataType_S8 => SYMM_DTYPE_INT8,
        XLA_FFI_DataType_U8 => SYMM_DTYPE_UINT8,
        XLA_FFI_DataType_S32 => SYMM_DTYPE_INT32,
        XLA_FFI_DataType_S64 => SYMM_DTYPE_INT64,
        other => {
            return Err(err!(
                InvalidArgument,
                "{name} has XLA data type {other}; symm takes float32, bfloat16, float16, float8_e4m3fn, \
                 float8_e5m2, int8, uint8, int32 and int64"
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_taken_once_and_leftovers_reported() {
        let mut a = Attrs { items: vec![("dim".into(), Attr::Int(1)), ("op".into(), Attr::Str("sum".into()))] };
        assert_eq!(a.int("dim").unwrap(), 1);
        assert!(a.int("dim").unwrap_err().msg.contains("missing"));
        assert!(a.int("op").unwrap_err().msg.contains("expected an integer"));
        let b = Attrs { items: vec![("typo".into(), Attr::Int(0))] };
        assert!(b.finish().unwrap_err().msg.contains("typo"));
    }

    #[test]
    fn integer_arrays_are_read_and_optional() {
        let mut values = [7i64, -2, 1 << 40];
        let mut array = XLA_FFI_Array { dtype: XLA_FFI_DataType_S64, size: 3, data: values.as_mut_ptr().cast() };
        // SAFETY: `array` points at `values`, alive here.
        let attr = unsafe { attr_value(XLA_FFI_AttrType_ARRAY, (&mut array as *mut XLA_FFI_Array).cast()) }.unwrap();
        assert_eq!(attr, Attr::Ints(vec![7, -2, 1 << 40]));
        let mut f32s = XLA_FFI_Array { dtype: XLA_FFI_DataType_F32, ..array };
        // SAFETY: as above.
        let other = unsafe { attr_value(XLA_FFI_AttrType_ARRAY, (&mut f32s as *mut XLA_FFI_Array).cast()) }.unwrap();
        assert!(matches!(other, Attr::Other(_)));
        let mut a = Attrs { items: vec![("groups".into(), attr), ("dim".into(), Attr::Int(1))] };
        assert_eq!(a.optional_ints("missing").unwrap(), None);
        assert_eq!(a.optional_ints("groups").unwrap(), Some(vec![7, -2, 1 << 40]));
        assert!(a.optional_ints("dim").unwrap_err().msg.contains("expected an array"));
    }

    /// An f32 buffer over `data` shaped `dims`, as XLA passes one.
    fn f32_buffer(data: &mut [f32], dims: &mut [i64]) -> XLA_FFI_Buffer {
        XLA_FFI_Buffer {
            struct_size: XLA_FFI_Buffer_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            dtype: XLA_FFI_DataType_F32,
            data: data.as_mut_ptr().cast(),
            rank: dims.len() as i64,
            dims: dims.as_mut_ptr(),
        }
    }

    #[test]
    fn tokens_are_skipped_and_other_kinds_refused() {
        let (mut dims, mut data) = ([4i64], [1f32; 4]);
        let f32_buf = f32_buffer(&mut data, &mut dims);
        let token = XLA_FFI_Buffer { dtype: XLA_FFI_DataType_TOKEN, rank: 0, ..f32_buffer(&mut [], &mut []) };
        let ptrs = [&token as *const XLA_FFI_Buffer as *mut c_void, &f32_buf as *const XLA_FFI_Buffer as *mut c_void];
        let bufs = buffers(&[XLA_FFI_ArgType_BUFFER; 2], &ptrs, XLA_FFI_ArgType_BUFFER, "argument").unwrap();
        assert_eq!(bufs.len(), 1);
        assert_eq!(bufs[0].array("x").unwrap().shape, vec![4]);
        let Err(e) = buffers(&[XLA_FFI_ArgType_BUFFER + 7; 2], &ptrs, XLA_FFI_ArgType_BUFFER, "argument") else {
            panic!("an argument of another kind was taken");
        };
        assert!(e.msg.contains("argument 0 is not a buffer"), "{}", e.msg);
    }

    #[test]
    fn buffers_become_row_major_arrays() {
        let (mut dims, mut data) = ([2i64, 3, 4], [0f32; 24]);
        let b = f32_buffer(&mut data, &mut dims);
        let a = XlaBuffer(&b).array("x").unwrap();
        assert_eq!((a.shape, a.strides), (vec![2, 3, 4], vec![12, 4, 1]));
        let s64 = XLA_FFI_Buffer { dtype: XLA_FFI_DataType_S64, ..b };
        assert_eq!(XlaBuffer(&s64).array("x").unwrap().dtype, crate::array::DType::I64);
        let s16 = XLA_FFI_Buffer { dtype: XLA_FFI_DataType_S16, ..b };
        assert!(XlaBuffer(&s16).array("x").unwrap_err().msg.contains("x has XLA data type 3"));
        let scalar = XLA_FFI_Buffer { rank: 0, ..b };
        assert!(XlaBuffer(&scalar).array("x").unwrap_err().msg.contains("0 dimensions"));
        // SAFETY: `b.dims` points at `dims`, alive here.
        unsafe { *b.dims.add(1) = 0 };
        assert!(XlaBuffer(&b).array("x").unwrap_err().msg.contains("x.shape[1] is 0"));
    }
}
