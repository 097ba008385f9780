"""One rank of a multi-process test (started by ranks.in_processes).

Forms its group from the environment (SYMM_TEST_BOOTSTRAP=uid: the hex
unique id in SYMM_TEST_UID; =env: torchrun's variables), then runs the
scenario named on the command line. A failure exits non-zero with its
traceback on stdout.
"""

import os
import sys

import scenarios

import symm


def form_group():
    how = os.environ["SYMM_TEST_BOOTSTRAP"]
    if how == "env":
        return symm.Group.from_env(backend="host", timeout_ms=10000)
    uid = bytes.fromhex(os.environ["SYMM_TEST_UID"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return symm.Group.from_unique_id(uid, world, rank, backend="host", timeout_ms=10000)


def main(scenario):
    with form_group() as group:
        assert group.rank == int(os.environ["RANK"])
        assert group.world_size == int(os.environ["WORLD_SIZE"])
        getattr(scenarios, scenario)(group)


if __name__ == "__main__":
    main(sys.argv[1])
