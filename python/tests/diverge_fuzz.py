"""Ranks that disagree, on randomly drawn calls.

Each case draws a valid call of any operation (ops_fuzz.draw), then one
rank, the odd one, makes a call that differs from its peers' in something
the ranks must share: the operation, a shape (rows, K, N, the number of
Bs), a dtype, the gathered or scattered dimension, the reduce op, the
forced algorithm, the fp8 scale mode or bias; or it makes no call at all
(a rank that never comes). It differs either on the
group's first call, or after every rank made the same call once (so the
peers' call is kept: they skip the agreement), or after every rank made
both calls once (both kept: neither rank exchanges its arguments), the
peers then repeating theirs plainly, through ``symm.bind``, or (CUDA) by
replaying the CUDA graph it was captured into. Each case has a group of its own, with a short timeout,
sometimes with check-args ``always``.

What the library promises (README, "A group fails for good"), checked on
every rank:

- nothing hangs: every rank's call ends (raises; on CUDA a peer's kept call
  may return, and its group then reports the failure) within a bound of
  the group's timeout;
- a first call that differs, or any differing call with check-args
  ``always`` (but for a graph's replay, which never reaches the library),
  fails on every rank before anything moves (``Mismatch``, or the odd
  rank's own refusal and ``Remote`` on its peers): no output element is
  written, every group still works, and the same ranks then run a valid
  call correctly;
- a kept call that one rank alone changes (or a graph replayed while that
  rank makes another call), and any call a rank never makes, fail the
  group on every rank: its peers wait for data that never comes, until the
  timeout, or (both calls kept) find the other call's tag at their first
  meeting; every rank's ``health()`` reports it (the absent rank's too),
  no host rank's call returns (nor, so, any data of the other call), and
  the next call is refused with ``SymmAbortedError``.

On the host backend (ranks as threads), as the CI test does:

    python3 python/tests/diverge_fuzz.py --backend host --world 3 --cases 40

On GPUs (one process per rank; rank r on device r % gpus):

    python3 python/tests/diverge_fuzz.py --backend cuda --world 2 --gpus 2 --cases 40
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

import symm
from ops_fuzz import INTS, NAMES, NumpyArrays, Runner, TorchArrays, describe, draw, poison

# The group's timeout per backend (ms), and how long past it a rank may
# take to see its call end and its group's state settle.
TIMEOUT_MS = {"host": 1500, "cuda": 3000}
MARGIN_S = 20.0
OTHER_DTYPE = {"f32": "bf16", "bf16": "f16", "f16": "bf16", "e4m3": "e5m2", "e5m2": "e4m3", "i8": "u8", "u8": "i8",
               "i32": "i64", "i64": "i32"}


# --- what the odd rank changes ------------------------------------------------------
# Each takes (rng, the case, world) and returns (the peers' case, the odd
# rank's case), or None where it does not apply; both calls are valid on
# their own, so only their difference can fail them.
def other_op(rng, c, world, backend):
    while True:
        v = plain(draw(rng, world, backend))
        if v["op"] != c["op"]:
            return c, v


def rows(rng, c, world, backend):
    if c["op"] == "ag_mm":
        return c, dict(c, shard=[c["shard"][0] + 1, *c["shard"][1:]])
    if c["op"] == "mm_rs":  # the scattered rows stay a multiple of the world
        return c, dict(c, a=[c["a"][0] + (world if c["dim"] == 0 else 1), *c["a"][1:]])
    return c, dict(c, shape=[c["shape"][0] + 1, *c["shape"][1:]])


def dtype(rng, c, world, backend):
    if c.get("fp8"):
        return None
    return c, dict(c, dtype=OTHER_DTYPE[c["dtype"]])


def k(rng, c, world, backend):
    if c["op"] == "ag_mm":
        kk = c["k"] + 16
        gathers_k = c["dim"] == len(c["shard"]) - 1
        return c, dict(c, k=kk, shard=[*c["shard"][:-1], kk], b_rows=kk * world if gathers_k else kk)
    if c["op"] == "mm_rs":
        return c, dict(c, k=c["k"] + 16, a=[*c["a"][:-1], c["k"] + 16])
    return None


def n(rng, c, world, backend):
    if c["op"] == "ag_mm":
        return c, dict(c, ns=[c["ns"][0] + 16, *c["ns"][1:]])
    if c["op"] == "mm_rs":  # a scattered N stays a multiple of 16 per rank
        return c, dict(c, n=c["n"] + 16 * world)
    return None


def num_b(rng, c, world, backend):
    if c["op"] != "ag_mm":
        return None
    return c, dict(c, ns=c["ns"][:-1] if len(c["ns"]) > 1 else c["ns"] * 2)


def dim(rng, c, world, backend):
    """3-D: gather or scatter the other leading dimension."""
    if c["op"] == "ag_mm" and len(c["shard"]) == 3 and c["dim"] < 2:
        return c, dict(c, dim=1 - c["dim"])
    if c["op"] == "mm_rs" and len(c["a"]) == 3 and c["dim"] < 2:
        a = [max(1, x // world) * world for x in c["a"][:2]] + c["a"][2:]
        return dict(c, a=a), dict(c, a=a, dim=1 - c["dim"])
    return None


def reduce_op(rng, c, world, backend):
    if c["op"] not in ("mm_rs", "all_reduce"):
        return None
    return c, dict(c, reduce="avg" if c["reduce"] == "sum" else "sum")


def algorithm(rng, c, world, backend):
    names = {"ag_mm": ("sequential", "pipelined"), "mm_rs": ("sequential", "pipelined"),
             "all_reduce": ("one_shot", "two_shot"), "rmsnorm": ("one_shot", "two_shot")}.get(c["op"])
    if names is None:
        return None
    x, y = names if rng.random() < 0.5 else names[::-1]
    return dict(c, algorithm=x), dict(c, algorithm=y)


def scales(rng, c, world, backend):
    """fp8: row-wise against tensor-wise scales (a row scale cannot cover
    a gathered K)."""
    if not c.get("fp8") or c["op"] == "ag_mm" and c["dim"] == len(c["shard"]) - 1:
        return None
    return c, dict(c, row_wise=not c["row_wise"])


def bias(rng, c, world, backend):
    if not c.get("fp8") or c["out_dtype"] == "f32":
        return None
    return c, dict(c, bias=not c["bias"])


def absent(rng, c, world, backend):
    """The odd rank makes no call."""
    return c, None


CHANGES = [other_op, rows, dtype, k, n, num_b, dim, reduce_op, algorithm, scales, bias, absent]


def plain(case):
    """`case` as the divergent rounds make it: no symmetric buffers (making
    one is itself collective), forced "fused" (declined where it cannot
    run), bind or graphs; torch's current stream."""
    c = dict(case, bind=False, graph=False, stream="current")
    for key in ("layout", "a_layout"):
        if c.get(key) == "symmetric":
            c[key] = "contiguous"
    if c.get("out") == "symmetric":
        c["out"] = "given"
    if c.get("algorithm") == "fused":
        c["algorithm"] = None
    return c


def draw_divergence(rng, world, backend, shared):
    """The case's two calls (peers', odd rank's), the odd rank, when it
    changes ("first", "kept", or "both": after every rank made both calls),
    how the peers repeat a kept call ("again", "bound" or "graph"), and
    whether the group checks arguments always."""
    while True:
        base = plain(draw(rng, world, backend))
        if shared and base["op"] == "all_reduce" and base["dtype"] in INTS:
            continue  # declined where ranks share a GPU
        change = CHANGES[int(rng.integers(0, len(CHANGES)))]
        pair = change(rng, base, world, backend)
        if pair is None:
            continue
        if shared and pair[1] is not None and pair[1]["op"] == "all_reduce" and pair[1]["dtype"] in INTS:
            continue
        when = str(rng.choice(["first", "kept", "both"]))
        if when == "both" and pair[1] is None:
            when = "kept"  # an absent call cannot be made first
        return {
            "calls": pair, "change": change.__name__, "odd": int(rng.integers(0, world)),
            "when": when, "check_always": bool(rng.random() < 0.25),
            "peers": str(rng.choice(["again", "bound"] + (["graph"] if backend == "cuda" else []))),
        }


# --- one case on one rank ---------------------------------------------------------
def written(dev, st):
    """The given outputs of a call (in its state `st`) holding anything but
    their poison: names of those written."""
    bad = []
    for key, value in st.items():
        if not (key.startswith("out") or key == "ag") or not isinstance(value, tuple):
            continue
        view, whole = value
        x = np.ascontiguousarray(dev.get(whole if whole is not None else view))
        if x.tobytes() != poison(NAMES[x.dtype], x.shape).tobytes():
            bad.append(key)
    return bad


def outcome_of(fn):
    """Runs `fn`; returns ("raised", the exception's class name) or
    ("returned", None), and the seconds it took."""
    t0 = time.perf_counter()
    try:
        fn()
        result = ("returned", None)
    except Exception as e:  # noqa: BLE001 -- every ending is a result here
        result = ("raised", type(e).__name__)
    return result, time.perf_counter() - t0


def settled_health(g, want_failed):
    """The group's health; where a failure is expected, polled until it shows
    (a peer learns it through the group's board) or the margin passes."""
    deadline = time.monotonic() + MARGIN_S
    while True:
        h = g.health()
        if h is not None or not want_failed or time.monotonic() > deadline:
            return None if h is None else type(h).__name__
        time.sleep(0.05)


def run_case(g, dev, backend, seed, index, d, exchange, shared):
    """One case on this rank; returns a list of problems (empty: passed)."""
    r = g.rank
    base, odd_call = d["calls"]
    mine = odd_call if r == d["odd"] else base
    runner = Runner(g, dev, seed, shared)
    problems = []
    st = {"symmetric": []}
    if d["when"] in ("kept", "both"):
        # Every rank makes the same call first (and binds it, or captures
        # it into a graph, where the peers repeat it so).
        first = {"again": ["plain"], "bound": ["plain", "bound"], "graph": ["plain", "graph"]}[d["peers"]]
        for i, round_ in enumerate(first):
            getattr(runner, base["op"])(base, np.random.default_rng([seed, index, 0, i]), round_, st)
        if d["when"] == "both":
            # And the odd rank's call, so that it is kept too.
            getattr(runner, odd_call["op"])(odd_call, np.random.default_rng([seed, index, 2]), "plain",
                                            {"symmetric": []})
        dev.sync()
        if r != d["odd"]:
            how = {"again": "again", "bound": "bound", "graph": "graph_again"}[d["peers"]]
        else:
            st, how = {"symmetric": []}, "plain"
    else:
        how = "plain"
    rng = np.random.default_rng([seed, index, 1])

    def divergent():
        getattr(runner, mine["op"])(mine, rng, how, st)
        dev.sync()

    if mine is None:
        (ended, error), seconds = ("absent", None), 0.0
    else:
        (ended, error), seconds = outcome_of(divergent)
    # A graph's replay never reaches the library, so check-args `always`
    # cannot catch the change there either; nor anything a call that never
    # comes.
    kept_unchecked = d["when"] in ("kept", "both") and (not d["check_always"] or d["peers"] == "graph")
    expect_failed = kept_unchecked or odd_call is None
    health = settled_health(g, expect_failed)
    untouched = not written(dev, st) if ended == "raised" else None
    everyone = exchange(index, {"rank": r, "ended": ended, "error": error, "seconds": seconds, "health": health,
                                "untouched": untouched})
    bound = 3 * TIMEOUT_MS[backend] / 1000 + MARGIN_S
    for o in everyone:
        who = f"rank {o['rank']}{' (odd)' if o['rank'] == d['odd'] else ''}"
        if o["seconds"] > bound:
            problems.append(f"{who}: its call took {o['seconds']:.1f} s (bound {bound:.0f})")
        if expect_failed:
            if o["health"] is None:
                problems.append(f"{who}: the group still works after a lone change of a kept call, or a rank's "
                                f"absence ({o['ended']} {o['error'] or ''})")
            if o["ended"] == "returned" and backend == "host":
                problems.append(f"{who}: its call returned (the host backend waits for its peers)")
        else:
            if o["ended"] != "raised" or o["error"] in ("SymmTimeoutError", "SymmAbortedError"):
                problems.append(f"{who}: expected an argument error on every rank, got {o['ended']} {o['error'] or ''}")
            if o["health"] is not None:
                problems.append(f"{who}: the group failed ({o['health']}) on a call every rank refused")
            if o["untouched"] is False:
                problems.append(f"{who}: a refused call wrote its outputs")
    if problems:
        return problems
    if expect_failed:
        # A failed group refuses the next call at once.
        (ended, error), seconds = outcome_of(lambda: symm.all_reduce(g, dev.put(np.ones(4, np.float32))))
        if error != "SymmAbortedError" or seconds > MARGIN_S:
            problems.append(f"rank {r}: the failed group's next call: {ended} {error or ''} after {seconds:.1f} s")
    else:
        # The group still works: a valid call, checked against float64.
        try:
            Runner(g, dev, seed + 1, shared).run(index, base)
        except Exception:  # noqa: BLE001
            problems.append(f"rank {r}: a valid call after the refused one failed:\n{traceback.format_exc()}")
    return problems


def run_rank(world, make_group, dev, backend, seed, cases, exchange, log=print, shared=False, only=None):
    """Draws and runs `cases` cases on this rank; `make_group(index,
    check_always)` gives the case's group, `exchange(index, outcome)` every
    rank's outcome. Returns (failures, cases run)."""
    rng = np.random.default_rng(seed)
    failures, done = [], 0
    for index in range(cases):
        d = draw_divergence(rng, world, backend, shared)
        if only is not None and index != only:
            continue
        g = make_group(index, d["check_always"])
        t0 = time.perf_counter()
        when = f"{d['when']} peers={d['peers']}" if d["when"] != "first" else "first"
        label = (f"case {index} change={d['change']} when={when} odd={d['odd']} "
                 f"check_always={d['check_always']} [{describe(d['calls'][0])}]")
        try:
            problems = run_case(g, dev, backend, seed, index, d, exchange, shared)
        except Exception:  # noqa: BLE001
            problems = [traceback.format_exc()]
        finally:
            g.close()
        done += 1
        if problems:
            failures.append(f"{label}: " + "; ".join(problems))
            odd = "none" if d["calls"][1] is None else f"[{describe(d['calls'][1])}]"
            log(f"rank {g.rank}: FAIL {label}\n  odd call: {odd}\n  " + "\n  ".join(problems))
            break  # the ranks' exchanges are out of step after a failure
        if g.rank == 0:
            log(f"{label} {time.perf_counter() - t0:.2f}s")
    return failures, done


def run_threads(world, seed, cases, log=print, only=None):
    """Every rank on a thread of this process, host backend, numpy arrays;
    returns every rank's failures and (failures, cases run)."""
    barrier = threading.Barrier(world)
    shared = {}

    def exchange(index, mine):
        shared.setdefault(index, {})[mine["rank"]] = mine
        barrier.wait()
        return [shared[index][r] for r in range(world)]

    results = [None] * world

    def main(i):
        def make_group(index, check_always):
            if barrier.wait() == 0:  # one thread forms every rank's group
                shared["groups"] = symm.local_groups(world, backend="host", timeout_ms=TIMEOUT_MS["host"],
                                                     check_args_always=check_always)
            barrier.wait()
            return shared["groups"][i]

        results[i] = run_rank(world, make_group, NumpyArrays(), "host", seed, cases, exchange, log, only=only)

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [f for res in results for f in res[0]], results


def rank_process(args):
    """One rank of a CUDA run (SYMM_TEST_RANK): a group per case from the
    ids in SYMM_TEST_UIDS, outcomes exchanged as files in SYMM_TEST_DIR."""
    import torch

    rank = int(os.environ["SYMM_TEST_RANK"])
    uids = os.environ["SYMM_TEST_UIDS"].split(",")
    folder = os.environ["SYMM_TEST_DIR"]
    device = rank % args.gpus
    torch.cuda.set_device(device)

    def make_group(index, check_always):
        return symm.Group.from_unique_id(bytes.fromhex(uids[index]), args.world, rank, device=device, backend="cuda",
                                         timeout_ms=TIMEOUT_MS["cuda"], allow_shared_device=args.gpus < args.world,
                                         check_args_always=check_always)

    def exchange(index, mine):
        with open(os.path.join(folder, f"{index}.{rank}.tmp"), "w") as f:
            json.dump(mine, f)
        os.rename(os.path.join(folder, f"{index}.{rank}.tmp"), os.path.join(folder, f"{index}.{rank}"))
        deadline = time.monotonic() + 300
        paths = [os.path.join(folder, f"{index}.{r}") for r in range(args.world)]
        while not all(os.path.exists(p) for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError(f"case {index}: the other ranks' outcomes did not come")
            time.sleep(0.02)
        return [json.load(open(p)) for p in paths]

    failures, done = run_rank(args.world, make_group, TorchArrays(torch, "cuda"), "cuda", args.seed, args.cases, exchange,
                              log=lambda s: print(s, flush=True), shared=args.gpus < args.world, only=args.case)
    print(f"rank {rank}: {done} cases, {len(failures)} failed", flush=True)
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["host", "cuda"], default="host")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--gpus", type=int, default=1, help="cuda: rank r runs on device r %% gpus")
    p.add_argument("--cases", type=int, default=40)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--case", type=int, help="run only case N of the seed's draws (to repeat a failure)")
    args = p.parse_args()
    if "SYMM_TEST_RANK" in os.environ:
        sys.exit(rank_process(args))
    print(f"diverge_fuzz backend={args.backend} world={args.world} seed={args.seed} cases={args.cases}", flush=True)
    if args.backend == "host":
        failures, _ = run_threads(args.world, args.seed, args.cases, only=args.case)
        ok = not failures
    else:
        with tempfile.TemporaryDirectory() as folder:
            uids = ",".join(symm.get_unique_id().hex() for _ in range(args.cases))
            env = dict(os.environ, SYMM_TEST_UIDS=uids, SYMM_TEST_DIR=folder)
            argv = [sys.executable, __file__, *sys.argv[1:], "--seed", str(args.seed)]
            procs = [subprocess.Popen(argv, env=dict(env, SYMM_TEST_RANK=str(r))) for r in range(args.world)]
            ok = all(p.wait() == 0 for p in procs)
    print(f"{'PASS' if ok else 'FAIL'} diverge_fuzz backend={args.backend} world={args.world} seed={args.seed} "
          f"cases={args.cases}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
