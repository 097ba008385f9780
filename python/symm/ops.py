"""The tensor-parallel operations: fused all-gather + matmul, matmul +
reduce-scatter, the copy-engine all-gather, and the all-reduce (alone or
fused with the residual add and RMSNorm).

Arrays are numpy arrays on the host backend; on CUDA, anything speaking
DLPack or ``__cuda_array_interface__`` (torch, cupy, ...). Outputs not
given are allocated like the first input (numpy, torch or cupy). Every call
is collective and stream-ordered: it returns once enqueued on ``stream``,
by default the current stream of the first array's framework (torch's or
cupy's; the NULL stream for other arrays), so that it runs after the work
that produced its inputs and before the work that reads its outputs.
Unlike torch's, no array may be empty: every dimension is at least 1 (an
empty one fails with ``SymmInvalidArgument``, before anything moves).

fp8 matmuls (``float8_e4m3fn`` / ``float8_e5m2`` inputs: ml_dtypes arrays on
the host, torch tensors on CUDA) take f32 scales and compute
``(a * a_scale) @ (b * b_scale) (+ bias)`` as ``torch._scaled_mm``: scales
of one element each are tensor-wise; otherwise ``a_scale`` has A's shape
with the last dimension 1 and ``b_scale`` is ``[1, N]`` (row-wise). B must
be column-major (``w.t()`` of a row-major ``[N, K]`` weight), K and N
multiples of 16; outputs are bf16, f16, f32 or fp8, and a bias (not with
f32 outputs) has the output's dtype (bf16 or f16 for fp8 outputs).
Outputs allocated without ``out_dtype`` are fp8, as torch's: B's type for
``fused_ag_mm`` (torch's ``out_dtype or B.dtype``), A's for ``mm_rs``. An
fp8 output is ``fp8(result * result_scale)``, rounded once to nearest even
and saturated to the format's largest finite value (NaN stays NaN), as
cuBLASLt's D scale: the meaning torch documents for ``scale_result``
(torch 2.11's ``_scaled_mm`` ignores it on CUDA).
``include/symm.h`` documents every rule.
"""

import contextlib
import ctypes
import functools
import inspect
import operator
import sys

from . import _fastcall, _lib
from ._alloc import empty_like
from ._lib import lib
from ._stream import operation_stream
from ._tensor import Arg, array_of
from .errors import SymmError, SymmInvalidArgument, error

REDUCE_OPS = {"sum": _lib.REDUCE_SUM, "avg": _lib.REDUCE_AVG}


def _dim(dim, ndim, name):
    """``dim`` in 0..ndim-1, counting from the end when negative (numpy style)."""
    try:
        if isinstance(dim, bool):  # an int to operator.index, but never a dimension
            raise TypeError
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {dim!r}") from None
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} is {dim}; expected {-ndim}..{ndim - 1} for {ndim} dimensions")
    return dim % ndim


# Public operation -> the function that prepares its _Call (see bind).
_BINDABLE = {}


def _bindable(fn):
    """The operation of the C function ``fn`` whose call ``prepare_call``
    prepares: made at once; ``bind`` prepares it only. Arguments that do
    not even fit the operation's signature (a name it does not take, one
    too many) are refused on this rank's group, as any other bad argument,
    so the peers fail at once instead of waiting for this rank."""

    def decorate(prepare_call):
        signature = inspect.signature(prepare_call)

        @functools.wraps(prepare_call)
        def prepared(*args, **kwargs):
            try:
                return prepare_call(*args, **kwargs)
            except TypeError as e:
                _refuse_unbound(signature, fn, args, kwargs, e)
                raise

        @functools.wraps(prepare_call)
        def op(*args, **kwargs):
            if not args:
                return prepared(*args, **kwargs)()
            ext = _fastcall._ext
            if ext is not None:  # the group stays in args: no slice, no frame of _fastcall.call
                return ext.call_op(prepared, args, kwargs)
            return _fastcall.call(args[0], prepared, args[1:], kwargs)

        _BINDABLE[op] = prepared
        return op

    return decorate


def _refuse_unbound(signature, fn, args, kwargs, why):
    """Refuses the call (``_refused``) with ``why`` where ``args`` and
    ``kwargs`` do not bind to ``signature`` (a TypeError from the body is
    the body's), on the group they name, if any."""
    try:
        signature.bind(*args, **kwargs)
        return
    except TypeError:
        pass
    group = args[0] if args else kwargs.get("group")
    if hasattr(type(group), "raw"):
        _refused(group, fn, why)


def bind(operation, group, /, *args, **kwargs):
    """``operation`` (``fused_ag_mm``, ``mm_rs`` or ``lc_allgather``) with
    its arguments read once: returns a function of no arguments that makes
    the call, collectively, each time it is called, and returns what the
    operation returns (outputs not given are allocated once, here).

    For loops that call an operation again and again on the same arrays (a
    decode step): a call then costs the library call alone, not the
    reading of every array, which at small sizes is most of an eager
    call's time. The arrays' pointers, shapes and strides are those of
    now, so they must stay where they are, and the stream is the one given
    now (or, with none given, the current one now). Every rank binds and
    calls alike. The bound call keeps the arrays alive, and a torch
    tensor's storage: re-pointed since (``set_``, ``.data =``), the tensor
    needs a new bind, and meanwhile the call still uses the memory it had.
    A bound tensor must not be resized: ``resize_`` to more elements frees
    the storage's memory in place, and the call would use freed memory
    (checking at every call would cost a bound call about a tenth of its
    host time).

    An argument that cannot be read fails here (and the peers' first call
    fails with ``SymmRemoteError``); the library checks the call, and that
    the ranks agree on it, at every call, as for the operation itself."""
    _ = group.raw  # a closed group (or one inherited through a fork) fails here, not at the first call
    prepare_call = _BINDABLE.get(operation)
    if prepare_call is None:
        raise TypeError(
            "bind takes symm.fused_ag_mm, symm.mm_rs, symm.lc_allgather, symm.all_reduce or "
            f"symm.all_reduce_rmsnorm, not {operation!r}"
        )
    call = prepare_call(group, *args, **kwargs)
    bound = _fastcall._args_in(call.keep, [])
    for arg in bound:
        if arg.copied:
            # The copy holds the values of now; a bound call promises those of each call.
            call.refuse(
                f"{arg.name} is {arg.copied}, whose values are not in its memory, so a bound call cannot read "
                "them there at each call; bind a tensor without the bit (x.resolve_neg(), x.resolve_conj())"
            )
    torch = sys.modules.get("torch")
    if torch is not None:
        # A tensor re-pointed since (set_, .data =) would free the memory bound here.
        call.storages = [a.obj.untyped_storage() for a in bound if isinstance(a.obj, torch.Tensor)]
    ext = _fastcall._ext
    if ext is not None:  # made from C (_fastcall_ext), without ctypes' conversions
        native = _fastcall._native(call.fn, call.args, (), (), None, ())
        if native is not None:
            call.native = functools.partial(ext.call_bound, native)
    return call


class _Call:
    """One collective call with its arguments read: the C function, its
    arguments, the arrays behind them (kept alive) and what the call
    returns. Calling it makes the call; ``bind`` keeps it to call again
    (`native`: through _fastcall_ext where it can). The torch tensors it
    writes (``written``) have their version bumped, as torch's in-place
    ops do."""

    __slots__ = ("group", "fn", "args", "keep", "result", "written", "native", "storages")

    def __init__(self, group, fn, args, keep, result):
        self.group, self.fn, self.args, self.keep, self.result = group, fn, args, keep, result
        self.written = _fastcall.written(keep)
        self.native, self.storages = None, ()

    def __call__(self):
        group = self.group
        if self.native is not None:
            self.native(group)
        else:
            group._check(self.fn(group.raw, *self.args))
        for t in self.written:
            _fastcall.bump(t)
        return self.result

    def refuse(self, message):
        """Raises ``SymmInvalidArgument`` with ``message`` instead of making
        the call, its peers told (``_refused``)."""
        _refused(self.group, self.fn, message)
        raise SymmInvalidArgument(_lib.ERROR_INVALID_ARGUMENT, f"{self.fn.__name__}: {message}")

    def __repr__(self):
        return f"<symm bound {self.fn.__name__} on {self.group!r}>"


def _refused(group, fn, message):
    """Enters the call of ``fn`` refused with ``message``
    (``symm_refuse_call``): it fails on every rank, the peers with
    ``SymmRemoteError`` quoting ``message``, instead of leaving them to
    wait for this one."""
    op = fn.__name__.removeprefix("symm_").encode()
    try:
        group._check(lib.symm_refuse_call(group.raw, op, str(message).encode(errors="replace"), None))
    except SymmError:
        pass  # certain: the call is refused; the error to report is the caller's


@contextlib.contextmanager
def refusing(group, fn):
    """Within: an exception (a binding's own check of its arguments before
    it calls ``fn``) refuses the call of ``fn`` on ``group`` (``_refused``)
    as it propagates, so the peers fail at once instead of waiting."""
    try:
        yield
    except Exception as e:
        _refused(group, fn, e)
        raise


def _prepared(group, fn, prepare):
    """The ``_Call`` of ``fn`` with ``args, keep, result = prepare()``.

    If ``prepare`` finds an argument symm cannot even be given, or fails
    otherwise (whatever an argument's own methods raise, an output that
    cannot be allocated), this rank still enters the call, refused
    (``_refused``), and raises ``SymmInvalidArgument`` (out of memory:
    ``SymmOutOfMemoryError``).
    """
    try:
        args, keep, result = prepare()
    except Exception as e:
        what = str(e) if isinstance(e, (TypeError, ValueError)) else f"{type(e).__name__}: {e}"
        _refused(group, fn, what)
        if isinstance(e, SymmError):
            raise
        status = _lib.ERROR_OUT_OF_MEMORY if _out_of_memory(e) else _lib.ERROR_INVALID_ARGUMENT
        raise error(status, f"{fn.__name__}: {what}") from e
    return _Call(group, fn, args, keep, result)


def _out_of_memory(e):
    """Whether ``e`` says memory ran out (Python's or torch's, a RuntimeError)."""
    torch = sys.modules.get("torch")
    return isinstance(e, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError)))


def _listed(x, n, name):
    """``x`` as a list of ``n`` (one value for a single B, or a list)."""
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    if len(items) != n:
        raise ValueError(f"{len(items)} {name} for {n} B matrices")
    return items


def _is_fp8(arg):
    return arg.dtype.startswith("float8")


def _ag_out_dtype(b, a, out_dtype):
    """The dtype of an output of ``fused_ag_mm`` by ``b`` allocated here:
    ``out_dtype``, else (as torch's ``out_dtype or B.dtype``) B's for an fp8
    matmul, else ``a``'s (None: ``empty_like``'s default)."""
    if out_dtype is not None or not _is_fp8(a):
        return out_dtype
    return b.dtype


ALGORITHMS = {
    None: _lib.ALGORITHM_AUTO,
    "auto": _lib.ALGORITHM_AUTO,
    "sequential": _lib.ALGORITHM_SEQUENTIAL,
    "pipelined": _lib.ALGORITHM_PIPELINED,
    "fused": _lib.ALGORITHM_FUSED,
}


def _algorithm(name, algorithms=ALGORITHMS):
    """The C value of an ``algorithm=`` keyword, one of ``algorithms``."""
    if not (name is None or isinstance(name, str)) or name not in algorithms:
        raise ValueError(f"algorithm is {name!r}; expected one of {sorted(k for k in algorithms if k)} or None")
    return algorithms[name]


# Option structs that hold only an algorithm, made once: the library
# only reads them, and a call's host time matters at small shapes.
_ALGORITHM_ONLY = {}


def _options(struct, algorithm=None, algorithms=ALGORITHMS, **tensors):
    """An option struct with the given tensor pointers (a descriptor, a C
    array of them, or None) and algorithm (one of ``algorithms``), or None
    when all are defaults."""
    code = _algorithm(algorithm, algorithms)
    if all(t is None for t in tensors.values()):
        if code == _lib.ALGORITHM_AUTO:
            return None
        key = (struct, code)
        if key not in _ALGORITHM_ONLY:
            _ALGORITHM_ONLY[key] = ctypes.pointer(struct(ctypes.sizeof(struct), algorithm=code))
        return _ALGORITHM_ONLY[key]
    ptr = ctypes.POINTER(_lib.Tensor)
    fields = {k: (None if t is None else ctypes.cast(ctypes.pointer(t), ptr)) for k, t in tensors.items()}
    return ctypes.pointer(struct(ctypes.sizeof(struct), algorithm=code, **fields))


def _with_ndim(arg, n, name):
    if len(arg.shape) != n:
        raise ValueError(f"{name} has {len(arg.shape)} dimensions; expected {n}")
    return arg


@_bindable(lib.symm_fused_ag_mm)
def fused_ag_mm(
    group,
    a_shard,
    bs,
    gather_dim,
    out=None,
    ag_out=None,
    return_ag=False,
    stream=None,
    a_scale=None,
    b_scales=None,
    biases=None,
    out_dtype=None,
    algorithm=None,
    result_scales=None,
):
    """``all_gather(a_shard, gather_dim) @ b`` for each ``b`` of ``bs``.

    ``a_shard`` is ``[..., K]`` (any strides); ``bs`` one ``[K, N]`` matrix
    or a list of them (``K * world`` rows when ``gather_dim`` is the last
    dimension), each row- or column-major (a weight or its transpose).
    Returns the output, or a list of them when ``bs`` is a list, each the
    gathered shape with last dimension N; with ``return_ag``, returns
    ``(gathered_a, outputs)``. ``out`` and ``ag_out`` are written when given.
    An ``a_shard`` contiguous in a rendezvoused symmetric buffer (at the same
    offset on every rank) is pulled by the peers where it is, not first
    copied into the group's workspace (not in fp8). Where it lies is agreed
    like its shape: in symmetric memory on some ranks only, or at different
    offsets, is ``SymmMismatchError``.

    fp8 (as torch's ``fused_all_gather_scaled_matmul``): ``a_scale``, and
    ``b_scales``, ``biases`` and ``result_scales`` given like ``bs`` (a bias
    or result scale may be None); ``out_dtype`` (one, or a list like
    ``bs``) is that of allocated outputs, by default each B's: fp8, as
    torch. A result scale (one f32) multiplies an fp8 output before it is
    rounded. A row-wise ``a_scale`` is gathered with the rows; a tensor-wise
    one scales the whole gathered A, so every rank passes the same value.

    ``algorithm``: "sequential", "pipelined" or "fused" to run that one
    (the same on every rank; "fused" where the fused kernel cannot run
    raises ``UnsupportedError``), or None for symm's choice (``SYMM_ALGO``,
    else the cost model's, as ``Group.plan`` reports).
    """
    single = not isinstance(bs, (list, tuple))

    def prepare():
        _algorithm(algorithm)
        b_objs = [bs] if single else list(bs)
        out_objs = None if out is None else ([out] if single else list(out))
        s = operation_stream(stream, a_shard)
        a = Arg(group, a_shard, "a_shard", s)
        b = [_with_ndim(Arg(group, x, f"bs[{i}]", s), 2, f"bs[{i}]") for i, x in enumerate(b_objs)]
        dim = _dim(gather_dim, len(a.shape), "gather_dim")
        gathered = list(a.shape)
        gathered[dim] *= group.world_size
        dtypes = _listed(out_dtype, len(b), "out_dtype") if isinstance(out_dtype, (list, tuple)) else [out_dtype] * len(b)
        outs = out_objs or [
            empty_like(a_shard, (*gathered[:-1], x.shape[1]), _ag_out_dtype(y, a, d))
            for x, y, d in zip(b, b_objs, dtypes)
        ]
        if len(outs) != len(b):
            raise ValueError(f"{len(outs)} outputs for {len(b)} B matrices")
        ag = ag_out if ag_out is not None or not return_ag else empty_like(a_shard, gathered)
        o = [Arg(group, x, f"out[{i}]", s, output=True) for i, x in enumerate(outs)]
        g = None if ag is None else Arg(group, ag, "ag_out", s, output=True)
        sa = None if a_scale is None else Arg(group, a_scale, "a_scale", s)
        sb = None
        if b_scales is not None:
            sb = [Arg(group, x, f"b_scales[{i}]", s) for i, x in enumerate(_listed(b_scales, len(b), "b_scales"))]
        bias = None
        if biases is not None:
            listed = _listed(biases, len(b), "biases")
            bias = [None if x is None else Arg(group, x, f"biases[{i}]", s) for i, x in enumerate(listed)]
        rs = None
        if result_scales is not None:
            listed = _listed(result_scales, len(b), "result_scales")
            rs = [None if x is None else Arg(group, x, f"result_scales[{i}]", s) for i, x in enumerate(listed)]

        opts = _options(
            _lib.AgMmOptions,
            algorithm=algorithm,
            a_scale=None if sa is None else sa.c,
            b_scales=None if sb is None else array_of(sb),
            biases=None if bias is None else array_of(bias),  # torch's Tensor?[]: None is absent
            result_scales=None if rs is None else array_of(rs),
        )
        args = (a.c, array_of(b), len(b), dim, None if g is None else g.c, array_of(o), opts, s)
        outs = outs[0] if single else outs
        return args, (a, b, o, g, sa, sb, bias, rs), ((ag, outs) if return_ag else outs)

    return _prepared(group, lib.symm_fused_ag_mm, prepare)


@_bindable(lib.symm_mm_rs)
def mm_rs(
    group,
    a,
    b,
    scatter_dim,
    op="sum",
    out=None,
    stream=None,
    a_scale=None,
    b_scale=None,
    bias=None,
    out_dtype=None,
    algorithm=None,
    result_scale=None,
):
    """``reduce_scatter(a @ b, op, scatter_dim)``: this rank's chunk of
    dimension ``scatter_dim`` of the product, summed (``op="sum"``) or
    averaged (``"avg"``) over the ranks. ``a`` is ``[..., K]``, ``b`` is
    ``[K, N]``. Returns ``out`` (allocated when not given, of ``out_dtype``,
    by default ``a``'s: fp8 for fp8 matmuls, as torch).

    fp8 (as torch's ``fused_scaled_matmul_reduce_scatter``): ``a_scale``,
    ``b_scale`` and ``bias``; each rank's product includes its bias, so a
    sum holds the biases of every rank. An fp8 ``out`` is the f32 sum
    rounded once, times ``result_scale`` (one f32) if given.

    ``algorithm``: as in ``fused_ag_mm``."""

    def prepare():
        _algorithm(algorithm)
        s = operation_stream(stream, a)
        if not isinstance(op, str) or op not in REDUCE_OPS:
            raise ValueError(f"op is {op!r}; expected one of {sorted(REDUCE_OPS)}")
        x = Arg(group, a, "a", s)
        y = _with_ndim(Arg(group, b, "b", s), 2, "b")
        dim = _dim(scatter_dim, len(x.shape), "scatter_dim")
        result = out
        if result is None:
            shape, world = [*x.shape[:-1], y.shape[1]], group.world_size
            if shape[dim] % world:
                raise ValueError(
                    f"dimension {dim} of the product ({shape[dim]}) does not divide by the world size ({world})"
                )
            shape[dim] //= world
            result = empty_like(a, tuple(shape), out_dtype)  # by default a's, as torch
        o = Arg(group, result, "out", s, output=True)
        given = {"a_scale": a_scale, "b_scale": b_scale, "bias": bias, "result_scale": result_scale}
        extra = {k: None if t is None else Arg(group, t, k, s) for k, t in given.items()}
        tensors = {k: None if t is None else t.c for k, t in extra.items()}
        opts = _options(_lib.MmRsOptions, algorithm=algorithm, **tensors)
        return (x.c, y.c, dim, REDUCE_OPS[op], o.c, opts, s), (x, y, o, extra), result

    return _prepared(group, lib.symm_mm_rs, prepare)


@_bindable(lib.symm_lc_allgather)
def lc_allgather(group, x, out=None, stream=None):
    """Gathers every rank's ``x`` along dimension 0 (``[world * d0, ...]``)
    with copy engines, leaving compute units to concurrent work; small
    messages (up to a few MiB per rank, on GPUs of their own) take one SM
    kernel instead, for latency. Returns ``out`` (allocated when not
    given)."""

    def prepare():
        s = operation_stream(stream, x)
        i = Arg(group, x, "input", s)
        result = out
        if result is None:
            if not i.shape:
                raise ValueError("input has no dimension 0 to gather along")
            result = empty_like(x, (i.shape[0] * group.world_size, *i.shape[1:]))
        o = Arg(group, result, "output", s, output=True)
        return (i.c, o.c, s), (i, o), result

    return _prepared(group, lib.symm_lc_allgather, prepare)


ALL_REDUCE_ALGORITHMS = {
    None: _lib.ALGORITHM_AUTO,
    "auto": _lib.ALGORITHM_AUTO,
    "one_shot": _lib.ALGORITHM_ONE_SHOT,
    "two_shot": _lib.ALGORITHM_TWO_SHOT,
}


def _all_reduce_options(algorithm):
    """The options of an all-reduce (None: the defaults)."""
    return _options(_lib.AllReduceOptions, algorithm, ALL_REDUCE_ALGORITHMS)


def _one_element_if_0d(arg):
    """``arg`` with a 0-d array described as ``[1]``: torch's all_reduce and
    JAX's psum take scalars, the library arrays of 1 to 8 dimensions."""
    if not arg.shape:
        c = arg.c
        c.ndim, c.shape[0], c.strides[0] = 1, 1, 1
    return arg


@_bindable(lib.symm_all_reduce)
def all_reduce(group, x, op="sum", out=None, stream=None, algorithm=None, inplace=False):
    """``x`` summed (``op="sum"``) or averaged (``"avg"``) over the ranks,
    elementwise, any shape (0-d too) and strides: f32, bf16 or f16 summed in f32;
    int8, uint8, int32 or int64 summed exactly in their own type, wrapping
    on overflow ("avg": the wrapped sum divided by the world size,
    truncating toward zero, as NCCL's ``ncclAvg``). Returns ``out``
    (allocated like ``x`` when not given), or ``x`` itself with
    ``inplace=True``. Every rank gets the same bits.

    ``algorithm``: "one_shot" (every rank reads all of every rank's data;
    small messages), "two_shot" (reduce-scatter, then all-gather; large
    ones), or None for symm's choice by size (``Group.plan("all_reduce",
    numel)``), the same on every rank. An ``x`` in a rendezvoused
    symmetric buffer (at the same offset on every rank: where it lies is
    agreed like its shape) is read by the peers where it is."""

    def prepare():
        opts = _all_reduce_options(algorithm)
        s = operation_stream(stream, x)
        if not isinstance(op, str) or op not in REDUCE_OPS:
            raise ValueError(f"op is {op!r}; expected one of {sorted(REDUCE_OPS)}")
        i = _one_element_if_0d(Arg(group, x, "input", s, output=inplace))
        if inplace:
            if out is not None:
                raise ValueError("out and inplace=True both given")
            return (i.c, i.c, REDUCE_OPS[op], opts, s), (i,), x
        result = out if out is not None else empty_like(x, tuple(i.shape))
        o = _one_element_if_0d(Arg(group, result, "output", s, output=True))
        return (i.c, o.c, REDUCE_OPS[op], opts, s), (i, o), result

    return _prepared(group, lib.symm_all_reduce, prepare)


@_bindable(lib.symm_all_reduce_rmsnorm)
def all_reduce_rmsnorm(
    group, x, residual, weight, eps=1e-6, out=None, residual_out=None, stream=None, algorithm=None, inplace=False
):
    """The all-reduce fused with the residual add and RMSNorm of inference
    engines: ``r = all_reduce_sum(x) + residual``, ``out = r /
    sqrt(mean(r**2, last dim) + eps) * weight``. ``x`` and ``residual`` are
    ``[..., hidden]``, ``weight`` is ``[hidden]``, all of one dtype (f32,
    bf16 or f16). Returns ``(out, residual_out)``; with ``inplace=True``,
    ``r`` goes into ``residual`` itself (returned as ``residual_out``).
    ``algorithm`` as in ``all_reduce``."""

    def prepare():
        opts = _all_reduce_options(algorithm)
        try:
            if isinstance(eps, (str, bytes, bool)):  # float() takes them; a typo, not an epsilon
                raise TypeError(f"{type(eps).__name__} {eps!r}")
            e = float(eps)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"eps is not a float: {exc}") from None
        s = operation_stream(stream, x)
        i = Arg(group, x, "input", s)
        # In place, the residual is also the output: checked as one.
        res = Arg(group, residual, "residual", s, output=inplace)
        w = Arg(group, weight, "weight", s)
        o_obj = out if out is not None else empty_like(x, tuple(i.shape))
        o = Arg(group, o_obj, "out", s, output=True)
        if inplace:
            if residual_out is not None:
                raise ValueError("residual_out and inplace=True both given")
            ro_obj, ro = residual, res
        else:
            ro_obj = residual_out if residual_out is not None else empty_like(x, tuple(i.shape))
            ro = Arg(group, ro_obj, "residual_out", s, output=True)
        return (i.c, res.c, w.c, e, o.c, ro.c, opts, s), (i, res, w, o, ro), (o_obj, ro_obj)

    return _prepared(group, lib.symm_all_reduce_rmsnorm, prepare)
