"""symm.symmetric_args: which arguments each operation uses in place from
symmetric memory (symm_op_symmetric_args; the operations' in-place reads
are tested in src/ops)."""

import inspect

import pytest

import symm
from symm import _info


def test_answers_per_operation():
    assert symm.symmetric_args("fused_ag_mm") == {"a_shard": "read"}
    assert symm.symmetric_args("mm_rs") == {"out": "write"}
    assert symm.symmetric_args("lc_allgather") == {"x": "read"}
    assert symm.symmetric_args("all_reduce") == {"x": "read"}
    assert symm.symmetric_args("all_reduce_rmsnorm") == {"x": "read"}
    assert symm.symmetric_args("all_reduce", c_names=True) == {"input": "read"}


@pytest.mark.parametrize("operation", _info.OPERATIONS)
def test_names_are_the_python_parameters(operation):
    params = inspect.signature(getattr(symm, operation)).parameters
    for name in symm.symmetric_args(operation):
        assert name in params, f"{operation} has no parameter {name}"


@pytest.mark.parametrize("bad", ["symm_all_reduce", "", "all-reduce", "fused_all_gather_matmul"])
def test_unknown_operation_is_refused_with_the_known_ones(bad):
    with pytest.raises(symm.SymmInvalidArgument, match="all_reduce_rmsnorm"):
        symm.symmetric_args(bad)
