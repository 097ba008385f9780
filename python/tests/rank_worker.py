"""One rank of a multi-process test (started by ranks.in_processes).

Forms its group from the environment (SYMM_TEST_BOOTSTRAP=uid: the hex
unique id in SYMM_TEST_UID; =env: torchrun's variables), then runs the
scenario named on the command line. A failure exits non-zero with its
traceback on stdout. With SYMM_TEST_FORM_FAILS=<text>, forming the group
must fail with SymmMismatchError (or the class SYMM_TEST_FORM_ERROR names)
containing the text, within SYMM_TEST_FORM_WITHIN seconds (default 5), and
nothing else runs.
"""

import os
import sys
import time

import scenarios

import symm


def form_group():
    how = os.environ["SYMM_TEST_BOOTSTRAP"]
    if how == "env":
        return symm.Group.from_env(backend=os.environ.get("SYMM_TEST_BACKEND", "host"), timeout_ms=10000)
    uid = bytes.fromhex(os.environ["SYMM_TEST_UID"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return symm.Group.from_unique_id(uid, world, rank, backend=os.environ.get("SYMM_TEST_BACKEND", "host"), timeout_ms=10000)


def main(scenario):
    expect = os.environ.get("SYMM_TEST_FORM_FAILS")
    if expect is not None:
        start = time.monotonic()
        error = getattr(symm, os.environ.get("SYMM_TEST_FORM_ERROR", "SymmMismatchError"))
        try:
            form_group().close()
        except error as e:
            took = time.monotonic() - start
            assert expect in str(e), f"{e} does not say {expect!r}"
            assert took < float(os.environ.get("SYMM_TEST_FORM_WITHIN", "5")), f"failed after {took:.1f} s"
            return
        raise AssertionError(f"the group formed; expected {error.__name__}")
    with form_group() as group:
        assert group.rank == int(os.environ["RANK"])
        assert group.world_size == int(os.environ["WORLD_SIZE"])
        getattr(scenarios, scenario)(group)


if __name__ == "__main__":
    main(sys.argv[1])
