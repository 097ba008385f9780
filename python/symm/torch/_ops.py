"""The ``torch.ops.symm`` operators: ``torch.ops.symm_mem``'s schemas and
semantics, run by symm. Each has a fake kernel (shapes and dtypes for
``torch.compile`` and meta tensors); the functional ones have autograd
formulas. The in-place and ``_out`` all-reduces keep torch's schemas
(they return the tensor they write) and decompose, when traced, into
``symm::_all_reduce_`` / ``symm::_all_reduce_out`` (which return nothing,
as functionalization needs)."""

import torch
from torch.distributed import _functional_collectives as funcol

import symm
from symm._lib import lib
from symm.ops import refusing

from ._groups import get_group, world_size

NAMESPACE = "symm"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # noqa: TOR901 -- the composite kernels below

REDUCE_OPS = ("sum", "avg")


class _Op:
    """An operator defined on ``_lib`` with its kernel for every device
    (plain ``Library`` registration: a call costs a fraction of
    ``torch.library.custom_op``'s wrappers), and ``register_fake``."""

    def __init__(self, name, schema, fn):
        self.qualname = f"{NAMESPACE}::{name}"
        _lib.define(name + schema)
        _lib.impl(name, fn, "CompositeExplicitAutograd")

    def register_fake(self, fn):
        return torch.library.register_fake(self.qualname, fn, lib=_lib)


def _op(name, schema):
    """Decorator: ``fn`` as the kernel of operator ``name`` (a mutated
    argument is marked ``(a!)`` in the schema)."""
    return lambda fn: _Op(name, schema, fn)


def _plain(t):
    """``t`` as symm reads it: a tensor requiring grad is read as its data
    (the op's autograd formula, not DLPack's refusal, handles grad)."""
    return t.detach() if t.requires_grad else t


def _check_reduce_op(reduce_op):
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op is {reduce_op!r}; symm supports {REDUCE_OPS}")


def _dim(dim, ndim, name):
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} is {dim}; expected {-ndim}..{ndim - 1} for {ndim} dimensions")
    return dim % ndim


def _gathered_shape(shape, dim, world):
    s = list(shape)
    s[dim] *= world
    return s


def _scattered_shape(shape, dim, world):
    s = list(shape)
    if s[dim] % world:
        raise ValueError(f"dimension {dim} ({s[dim]}) does not divide by the world size ({world})")
    s[dim] //= world
    return s


# --- all-gather + matmul ------------------------------------------------------
@_op(
    "fused_all_gather_matmul",
    "(Tensor A, Tensor[] Bs, int gather_dim, str group_name, *, bool return_A=True) -> (Tensor?, Tensor[])",
)
def fused_all_gather_matmul(A, Bs, gather_dim, group_name, *, return_A=True):
    g, Bs = get_group(group_name), [_plain(b) for b in Bs]
    got = symm.fused_ag_mm(g, _plain(A), Bs, gather_dim, return_ag=return_A)
    return got if return_A else (None, got)


@fused_all_gather_matmul.register_fake
def _(A, Bs, gather_dim, group_name, *, return_A=True):
    dim = _dim(gather_dim, A.dim(), "gather_dim")
    full = _gathered_shape(A.shape, dim, world_size(group_name))
    outs = [A.new_empty((*full[:-1], B.shape[1])) for B in Bs]
    return (A.new_empty(full) if return_A else None), outs


def _all_gather(A, gather_dim, group_name):
    """``A`` gathered along ``gather_dim`` (symm's copy-engine all-gather)."""
    moved = A.movedim(gather_dim, 0).contiguous()
    return torch.ops.symm._low_contention_all_gather(moved, group_name).movedim(0, gather_dim)


def _reduce_scatter(x, dim, group_name):
    """The sum over ranks of ``x``, chunk ``rank`` of dimension ``dim``."""
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, group_name))


def _ag_mm_setup(ctx, inputs, keyword_only_inputs, output):
    A, Bs, gather_dim, group_name = inputs
    ctx.gather_dim, ctx.group_name = _dim(gather_dim, A.dim(), "gather_dim"), group_name
    ctx.num_b = len(Bs)
    gathered = output[0] if keyword_only_inputs.get("return_A", True) else None
    ctx.save_for_backward(A, gathered, *Bs)


def _ag_mm_backward(ctx, grad_gathered, grad_outs):
    """The transpose of all-gather + matmul: A's gradient is the matmul +
    reduce-scatter of the outputs' gradients (all Bs in one call), B's the
    gathered A times its output's gradient."""
    A, gathered, *Bs = ctx.saved_tensors
    dim, name = ctx.gather_dim, ctx.group_name
    used = [(g.contiguous(), B) for g, B in zip(grad_outs, Bs) if g is not None]
    grad_A = grad_Bs = None
    if ctx.needs_input_grad[0]:
        parts = []
        if used:
            dC = torch.cat([g for g, _ in used], -1) if len(used) > 1 else used[0][0]
            Bt = torch.cat([B for _, B in used], 1).t() if len(used) > 1 else used[0][1].t()
            parts.append(torch.ops.symm.fused_matmul_reduce_scatter(dC, Bt, "sum", dim, name))
        if grad_gathered is not None:
            parts.append(_reduce_scatter(grad_gathered, dim, name))
        grad_A = sum(parts[1:], parts[0]) if parts else torch.zeros_like(A)
    if ctx.needs_input_grad[1]:
        if gathered is None:
            gathered = _all_gather(A, dim, name)
        rows = gathered.flatten(0, -2)
        grad_Bs = [
            (rows.t() @ g.flatten(0, -2)) if g is not None else torch.zeros_like(B) for g, B in zip(grad_outs, Bs)
        ]
    return grad_A, grad_Bs, None, None


torch.library.register_autograd(
    f"{NAMESPACE}::fused_all_gather_matmul", _ag_mm_backward, setup_context=_ag_mm_setup
)


# --- matmul + reduce-scatter --------------------------------------------------
@_op(
    "fused_matmul_reduce_scatter",
    "(Tensor A, Tensor B, str reduce_op, int scatter_dim, str group_name) -> Tensor",
)
def fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    return symm.mm_rs(get_group(group_name), _plain(A), _plain(B), scatter_dim, op=reduce_op)


@fused_matmul_reduce_scatter.register_fake
def _(A, B, reduce_op, scatter_dim, group_name):
    _check_reduce_op(reduce_op)
    dim = _dim(scatter_dim, A.dim(), "scatter_dim")
    return A.new_empty(_scattered_shape((*A.shape[:-1], B.shape[1]), dim, world_size(group_name)))


def _mm_rs_setup(ctx, inputs, output):
    A, B, reduce_op, scatter_dim, group_name = inputs
    ctx.scatter_dim, ctx.group_name = _dim(scatter_dim, A.dim(), "scatter_dim"), group_name
    ctx.avg = reduce_op == "avg"
    ctx.save_for_backward(A, B)


def _mm_rs_backward(ctx, grad):
    """The transpose of matmul + reduce-scatter: all-gather + matmul of the
    gradient by B's transpose gives A's gradient, and the gathered gradient
    (returned by the same call) B's."""
    A, B = ctx.saved_tensors
    need_A, need_B = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.avg:
        grad = grad / world_size(ctx.group_name)
    gathered, (grad_A,) = torch.ops.symm.fused_all_gather_matmul(
        grad.contiguous(), [B.t()], ctx.scatter_dim, ctx.group_name, return_A=need_B
    )
    grad_B = A.flatten(0, -2).t() @ gathered.flatten(0, -2) if need_B else None
    return (grad_A if need_A else None), grad_B, None, None, None


torch.library.register_autograd(
    f"{NAMESPACE}::fused_matmul_reduce_scatter", _mm_rs_backward, setup_context=_mm_rs_setup
)


# --- copy-engine all-gather ---------------------------------------------------
@_op("_low_contention_all_gather", "(Tensor tensor, str group_name) -> Tensor")
def _low_contention_all_gather(tensor, group_name):
    return symm.lc_allgather(get_group(group_name), _plain(tensor))


@_low_contention_all_gather.register_fake
def _(tensor, group_name):
    return tensor.new_empty((tensor.shape[0] * world_size(group_name), *tensor.shape[1:]))


def _lc_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _lc_backward(ctx, grad):
    return _reduce_scatter(grad, 0, ctx.group_name), None


torch.library.register_autograd(f"{NAMESPACE}::_low_contention_all_gather", _lc_backward, setup_context=_lc_setup)


# --- all-reduce ---------------------------------------------------------------
@_op("one_shot_all_reduce", "(Tensor input, str reduce_op, str group_name) -> Tensor")
def one_shot_all_reduce(input, reduce_op, group_name):
    return symm.all_reduce(get_group(group_name), _plain(input), op=reduce_op, algorithm="one_shot")


@one_shot_all_reduce.register_fake
def _(input, reduce_op, group_name):
    _check_reduce_op(reduce_op)
    return input.new_empty(input.shape)


def _ar_setup(ctx, inputs, output):
    ctx.reduce_op, ctx.group_name = inputs[1], inputs[2]


def _ar_backward(ctx, grad):
    # d/dx_r of sum_s L_s(reduce(x)) = reduce(grad) for sum and for avg.
    return torch.ops.symm.one_shot_all_reduce(grad.contiguous(), ctx.reduce_op, ctx.group_name), None, None


torch.library.register_autograd(f"{NAMESPACE}::one_shot_all_reduce", _ar_backward, setup_context=_ar_setup)

ALL_REDUCE_ALGORITHMS = ("one_shot", "two_shot", "auto")


@_op(
    "_all_reduce_",
    "(Tensor(a!) input, str reduce_op, str group_name, str algorithm) -> ()",
)
def _all_reduce_(input, reduce_op, group_name, algorithm):
    algo = None if algorithm == "auto" else algorithm
    symm.all_reduce(get_group(group_name), input, op=reduce_op, algorithm=algo, inplace=True)  # bumps its version


@_all_reduce_.register_fake
def _(input, reduce_op, group_name, algorithm):
    _check_reduce_op(reduce_op)


@_op(
    "_all_reduce_out",
    "(Tensor input, str reduce_op, str group_name, str algorithm, Tensor(a!) out) -> ()",
)
def _all_reduce_out(input, reduce_op, group_name, algorithm, out):
    algo = None if algorithm == "auto" else algorithm
    symm.all_reduce(get_group(group_name), _plain(input), op=reduce_op, algorithm=algo, out=out)  # bumps out's


@_all_reduce_out.register_fake
def _(input, reduce_op, group_name, algorithm, out):
    _check_reduce_op(reduce_op)
    if out.shape != input.shape or out.dtype != input.dtype:
        raise ValueError(f"out is {out.dtype}{list(out.shape)}; expected input's {input.dtype}{list(input.shape)}")


def _define_composite(schema, fn):
    """An operator with torch's (aliasing) schema whose kernel, traced or
    eager, is ``fn`` over the functionalizable ops above."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, fn, "CompositeImplicitAutograd")


def _in_place(algorithm):
    def kernel(input, reduce_op, group_name):
        torch.ops.symm._all_reduce_(input, reduce_op, group_name, algorithm)
        return input

    return kernel


def _into(algorithm):
    def kernel(input, reduce_op, group_name, out):
        torch.ops.symm._all_reduce_out(input, reduce_op, group_name, algorithm, out)
        return out

    return kernel


_define_composite(
    "one_shot_all_reduce_out(Tensor input, str reduce_op, str group_name, Tensor(a!) out) -> Tensor(a!)",
    _into("one_shot"),
)
_define_composite(
    "two_shot_all_reduce_(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)", _in_place("two_shot")
)
_define_composite(
    "two_shot_all_reduce_out(Tensor(a!) input, str reduce_op, str group_name, Tensor(b!) output) -> Tensor(b!)",
    _into("two_shot"),
)
# torch's multimem all-reduce needs multicast; symm has none, so this is
# the same in-place all-reduce with symm's choice of algorithm, under the
# same name for a one-word migration.
_define_composite(
    "multimem_all_reduce_(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)", _in_place("auto")
)


# --- fp8 ----------------------------------------------------------------------
# c10::ScalarType codes of the output dtypes symm writes: a ScalarType?[]
# argument reaches a Python kernel as these ints.
_SCALAR_TYPES = {
    5: torch.float16,
    6: torch.float32,
    15: torch.bfloat16,
    23: torch.float8_e5m2,
    24: torch.float8_e4m3fn,
}


def _out_dtype(out_dtype, default, what):
    """The output dtype of a scaled op: ``out_dtype``, else torch's default
    (an fp8 operand's dtype, as torch's ops do)."""
    if isinstance(out_dtype, int):
        if out_dtype not in _SCALAR_TYPES:
            raise ValueError(f"{what}: out_dtype ScalarType {out_dtype} is not bf16, f16, f32 or fp8")
        out_dtype = _SCALAR_TYPES[out_dtype]
    return default if out_dtype is None else out_dtype


def _result_scale(t):
    """torch's result scale (0-d or one element) as symm's, or None."""
    return None if t is None else _scale(t)


def _scale(t):
    """A 0-d (tensor-wise) scale as symm's one-element vector."""
    return t.reshape(1) if t.dim() == 0 else t


def _a_scale_shard(A_scale, A_shard, gather_dim, world, rank):
    """torch's three A-scale layouts as symm's, and whether it is row-wise:
    row-wise of the shard (``[..., 1]`` with the shard's leading shape,
    tested first as torch does: a one-row shard's ``[1, 1]`` scale is this
    row's, gathered with it) as it is; else one element, tensor-wise;
    else row-wise of the gathered A (replicated) cut to this rank's rows."""
    if A_scale.dim() == A_shard.dim() and A_scale.shape[:-1] == A_shard.shape[:-1] and A_scale.shape[-1] == 1:
        return A_scale, True
    if A_scale.numel() == 1:
        return _scale(A_scale), False
    full = _gathered_shape(A_shard.shape, gather_dim, world)
    if list(A_scale.shape[:-1]) == full[:-1] and A_scale.shape[-1] == 1:
        n = A_shard.shape[gather_dim]
        return A_scale.narrow(gather_dim, rank * n, n), True
    raise ValueError(f"A_scale has shape {list(A_scale.shape)}; A_shard {list(A_shard.shape)} takes no such scale")


def _b_scale(B_scale, B, row_wise):
    """A B scale as symm's: with a row-wise A scale, a one-element one
    spread over ``[1, N]`` (symm reads one-element scales on both sides
    as tensor-wise, which would scale the gathered A by this rank's A
    scale alone)."""
    if row_wise and B_scale.numel() == 1:
        return B_scale.reshape(1, 1).expand(1, B.shape[1]).contiguous()
    return _scale(B_scale)


@_op(
    "fused_all_gather_scaled_matmul",
    "(Tensor A, Tensor[] Bs, Tensor A_scale, Tensor[] B_scales, int gather_dim, str group_name, Tensor?[] biases, "
    "Tensor?[] result_scales, ScalarType?[] out_dtypes, bool[] use_fast_accum) -> (Tensor, Tensor[])",
)
def fused_all_gather_scaled_matmul(
    A, Bs, A_scale, B_scales, gather_dim, group_name, biases, result_scales, out_dtypes, use_fast_accum
):
    what = "fused_all_gather_scaled_matmul"
    g = get_group(group_name)
    with refusing(g, lib.symm_fused_ag_mm):  # a bad argument fails every rank's call
        per_b = {
            "B_scales": B_scales,
            "biases": biases,
            "result_scales": result_scales,
            "out_dtypes": out_dtypes,
            "use_fast_accum": use_fast_accum,
        }
        for name, items in per_b.items():
            if len(items) != len(Bs):
                raise ValueError(f"{what}: {len(items)} {name} for {len(Bs)} Bs")
        dim = _dim(gather_dim, A.dim(), "gather_dim")
        full = _gathered_shape(A.shape, dim, g.world_size)
        # One dtype per B, torch's default being the B's (fp8).
        dtypes = [_out_dtype(d, B.dtype, what) for B, d in zip(Bs, out_dtypes)]
        outs = [A.new_empty((*full[:-1], B.shape[1]), dtype=d) for B, d in zip(Bs, dtypes)]
        a_scale, row_wise = _a_scale_shard(A_scale, A, dim, g.world_size, g.rank)
        b_scales = [_b_scale(s, B, row_wise) for s, B in zip(B_scales, Bs)]
    ag, outs = symm.fused_ag_mm(
        g,
        A,
        list(Bs),
        dim,
        out=outs,
        return_ag=True,
        a_scale=a_scale,
        b_scales=b_scales,
        biases=list(biases),
        result_scales=[_result_scale(r) for r in result_scales],
    )
    return ag, outs


@fused_all_gather_scaled_matmul.register_fake
def _(A, Bs, A_scale, B_scales, gather_dim, group_name, biases, result_scales, out_dtypes, use_fast_accum):
    what = "fused_all_gather_scaled_matmul"
    full = _gathered_shape(A.shape, _dim(gather_dim, A.dim(), "gather_dim"), world_size(group_name))
    outs = [A.new_empty((*full[:-1], B.shape[1]), dtype=_out_dtype(d, B.dtype, what)) for B, d in zip(Bs, out_dtypes)]
    return A.new_empty(full), outs


def _scaled_mm_rs_operands(A, A_scale, output_shape):
    """A (and a row-wise A_scale) in the output's leading shape: torch's op
    may take A flattened to a matrix, with the output's shape beside it."""
    if output_shape is None:
        return A, _scale(A_scale)
    lead = list(output_shape[:-1])
    a = A.reshape(*lead, A.shape[-1])
    scale = _scale(A_scale) if A_scale.numel() == 1 else A_scale.reshape(*lead, 1)
    return a, scale


@_op(
    "fused_scaled_matmul_reduce_scatter",
    "(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, str reduce_op, int orig_scatter_dim, "
    "int scatter_dim_after_maybe_reshape, str group_name, SymInt[]? output_shape, Tensor? bias=None, "
    "Tensor? result_scale=None, ScalarType? out_dtype=None, bool use_fast_accum=False) -> Tensor",
)
def fused_scaled_matmul_reduce_scatter(
    A,
    B,
    A_scale,
    B_scale,
    reduce_op,
    orig_scatter_dim,
    scatter_dim_after_maybe_reshape,
    group_name,
    output_shape,
    bias=None,
    result_scale=None,
    out_dtype=None,
    use_fast_accum=False,
):
    what = "fused_scaled_matmul_reduce_scatter"
    g = get_group(group_name)
    with refusing(g, lib.symm_mm_rs):  # a bad argument fails every rank's call
        a, scale = _scaled_mm_rs_operands(A, A_scale, output_shape)
        dtype = _out_dtype(out_dtype, A.dtype, what)
        b_scale = _b_scale(B_scale, B, scale.numel() > 1)
    return symm.mm_rs(
        g,
        a,
        B,
        orig_scatter_dim,
        op=reduce_op,
        a_scale=scale,
        b_scale=b_scale,
        bias=bias,
        result_scale=_result_scale(result_scale),
        out_dtype=dtype,
    )


@fused_scaled_matmul_reduce_scatter.register_fake
def _(
    A,
    B,
    A_scale,
    B_scale,
    reduce_op,
    orig_scatter_dim,
    scatter_dim_after_maybe_reshape,
    group_name,
    output_shape,
    bias=None,
    result_scale=None,
    out_dtype=None,
    use_fast_accum=False,
):
    what = "fused_scaled_matmul_reduce_scatter"
    _check_reduce_op(reduce_op)
    shape = list(output_shape) if output_shape is not None else [*A.shape[:-1], B.shape[1]]
    dim = _dim(orig_scatter_dim, len(shape), "orig_scatter_dim")
    return A.new_empty(_scattered_shape(shape, dim, world_size(group_name)), dtype=_out_dtype(out_dtype, A.dtype, what))


# torch.ops.symm_mem's operators that torch.ops.symm has, by name.
OPERATORS = (
    "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul",
    "fused_matmul_reduce_scatter",
    "fused_scaled_matmul_reduce_scatter",
    "_low_contention_all_gather",
    "one_shot_all_reduce",
    "one_shot_all_reduce_out",
    "two_shot_all_reduce_",
    "two_shot_all_reduce_out",
    "multimem_all_reduce_",
)
