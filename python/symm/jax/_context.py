"""Where an operation is traced: the shard_map axis it runs over, checked at
trace time against the group (a call that cannot meet its peers must fail
here, not after the group's timeout), and how values vary over that axis
(``check_vma``), which the gradients must respect.

JAX types every value inside ``shard_map(check_vma=True)`` with the manual
axes it varies over. A cotangent that varies over the axis holds one
device's share (the true gradient sums them); one that does not holds the
total already. With ``check_vma=False`` nothing is typed and every
cotangent is a share.
"""

import jax
from jax._src import config as _config  # shard_map's check_vma flag; no public reader

from ._setup import state

HOW = (
    "call symm.jax operations on per-device arrays inside "
    "jax.shard_map(f, mesh=symm.jax.mesh(axis), ...) over the axis of the group's devices, in rank order"
)


def axis(axis_name):
    """The shard_map axis the call runs over (``axis_name``, or the
    enclosing shard_map's only manual axis of more than one device) and the
    group's size; ValueError when the call cannot meet its group."""
    world = len(state().devices)
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(getattr(mesh, "manual_axes", ()) or ()) if not mesh.empty else ()
    if not manual:
        raise ValueError(f"a symm collective is traced outside jax.shard_map; {HOW} (world {world})")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if axis_name is None:
        wide = [a for a in manual if sizes[a] > 1] or list(manual)
        if len(wide) != 1:
            raise ValueError(f"the shard_map has manual axes {manual}; pass axis_name= naming the one of the group")
        axis_name = wide[0]
    elif axis_name not in manual:
        raise ValueError(
            f"axis {axis_name!r} is not a manual axis of the enclosing shard_map (those are {manual}); {HOW}"
        )
    if sizes[axis_name] != world:
        raise ValueError(
            f"axis {axis_name!r} has {sizes[axis_name]} devices but the symm group {world}; "
            f"{HOW} (symm.jax.init(devices) forms the group)"
        )
    if mesh.size != world:
        raise ValueError(
            f"the mesh has {mesh.size} devices but the symm group {world}: every device of the mesh runs the call, "
            f"so the group must span them all; {HOW}"
        )
    return axis_name, world


def checked():
    """Whether values carry their varying axes (shard_map's check_vma)."""
    return bool(_config._check_vma.value)


def vma(x):
    """The manual axes ``x`` varies over (empty without check_vma)."""
    if not checked():
        return frozenset()
    return frozenset(jax.typeof(x).mat.varying)


def vary(x, axes):
    """``x`` typed as varying over ``axes`` too (no data moves)."""
    extra = tuple(sorted(frozenset(axes) - vma(x)))
    return jax.lax.pcast(x, extra, to="varying") if extra else x


def fit(ct, want):
    """A cotangent typed as its primal input, which varies over ``want``:
    summed over the axes it varies over and the primal does not (the
    transpose of the implicit broadcast of an invariant input), typed
    varying over the primal's other axes."""
    extra = tuple(sorted(vma(ct) - want))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return vary(ct, want)


def is_share(ct, axis_name):
    """Whether ``ct`` is one device's share of the gradient (to be summed
    over the devices) rather than the total."""
    return not checked() or axis_name in vma(ct)


def result(ref, shape, dtype, axes):
    """The aval of an FFI result: ``shape``/``dtype``, varying over ``axes``."""
    aval = jax.typeof(ref)
    mat = aval.mat.update(varying=frozenset(axes) if checked() else frozenset())
    return aval.update(shape=tuple(shape), dtype=dtype, manual_axis_type=mat)
