"""Inside the fused kernel: per-CTA timelines of fused mm_rs / ag_mm calls
from the kernel's own %globaltimer stamps (`SYMM_TRACE_SM90`, see
src/backend/cuda/sm90_trace.rs), on the GPU machine, one rank per GPU:

    torchrun --nproc-per-node 2 bench/gpu/fused_trace.py --out DIR [--cases mm_rs:512:14336:8192,...]

Each traced call starts from idle GPUs after a barrier, as the benchmark's
samples do (the trace waits for every launch, so calls cannot run back to
back); the ranks' kernels then start tens of us apart or more. With
--in-step each call is queued behind a ~0.1 ms sleep and a stream-ordered
symm barrier, so that both ranks' kernels start within a few us of each
other, as in the benchmark's graph replays. For each of the last --calls calls rank 0 prints, per rank, in us
from that rank's first CTA start: when the CTAs started, finished their
mainloops, issued their epilogue stores, had their pushes complete and
flagged (peers' tiles), saw the peers' flags and added their partials
(own tiles), had their last stores read from shared memory, and ended,
as min / median / max over the CTAs of each kind. The raw traces stay in
DIR (one file per rank process); `--summarize DIR --cases ...` prints the
same from them anywhere, without a GPU. `--groups 16,28,24` splits the
peers' tiles, in the order their mainloops ended, into groups of those
sizes (mm_rs 512's narrow widths 232, 240, 248: their k-loops end in that
order) and prints each group's rows too.
"""
import argparse
import glob
import os
import statistics
import sys

DEFAULT_CASES = "mm_rs:512:14336:8192,mm_rs:2048:14336:8192,ag_mm:512:8192:14336"


def read_traces(prefix):
    """{(launch, rank): [per-CTA dict]} of every rank's file, keyed by the
    column names of the file's header line (`sm90_trace.rs` writes them)."""
    launches = {}
    for path in glob.glob(f"{prefix}.*.txt"):
        with open(path) as f:
            names = None
            for line in f:
                if line.startswith("#"):
                    names = line[1:].split()
                    continue
                if not line.strip():
                    continue
                row = dict(zip(names, (int(x) for x in line.split())))
                for slot in ("ready", "boxes", "handed", "first_in", "last_in"):  # traces from before these stamps
                    row.setdefault(slot, 0)
                launches.setdefault((row["launch"], row["rank"]), []).append(row)
    return launches


def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def summarize(ctas, rank, origin, groups=()):
    """Lines for one rank's launch, times in us after `origin` (ns);
    `groups`: sizes of the peers' tiles' groups to print apart (see
    --groups)."""
    us = lambda c, slot: (c[slot] - origin) / 1e3 if c[slot] else None
    peer = [c for c in ctas if c["chunk"] and c["chunk"] - 1 != rank]
    own = [c for c in ctas if c["chunk"] and c["chunk"] - 1 == rank]
    lines = [f"    {'':34}{'min':>7} {'median':>7} {'max':>7}   ({len(peer)} CTAs last on a peer's tile, {len(own)} on an own)"]
    if groups and sum(groups) == len(peer):
        by_end = sorted(peer, key=lambda c: c["mainloop"])
        for g, size in enumerate(groups):
            part, by_end = by_end[:size], by_end[size:]
            lines.append(f"    peers' tiles, group {g} ({size} CTAs, k-loops ending {'first' if g == 0 else 'next'})")
            for name, slot in (("mainloop done", "mainloop"), ("TMA stores issued", "boxes"),
                               ("stores issued", "epilogue"), ("pushes complete", "pushed"),
                               ("both warpgroups' complete", "handed"), ("flag set", "flagged")):
                if any(c[slot] for c in part):
                    lines.append(f"      {name:32}{spread([us(c, slot) for c in part])}")
    rows = [("start, every CTA", ctas, "start"),
            ("mainloop done, peers' tiles", peer, "mainloop"),
            ("mainloop done, own tiles", own, "mainloop"),
            ("peers' inboxes free, peers' tiles", peer, "ready"),
            ("TMA stores issued, peers' tiles", peer, "boxes"),
            ("stores issued, peers' tiles", peer, "epilogue"),
            ("pushes complete, peers' tiles", peer, "pushed"),
            ("both warpgroups' complete, peers'", peer, "handed"),
            ("flag set, peers' tiles", peer, "flagged"),
            # Since v20 the producer stamps "partials" once its last box of
            # partials is issued (each box waits for its own flags), and with
            # the sums stored from the ring "added" comes once those stores
            # have read it.
            ("flags seen/loads issued, own tiles", own, "partials"),
            ("first partials landed, own tiles", own, "first_in"),
            ("last partials landed, own tiles", own, "last_in"),
            ("partials added, own tiles", own, "added"),
            ("stores issued, own tiles", own, "epilogue"),
            ("last stores read, peers' tiles", peer, "drained"),
            ("last stores read, own tiles", own, "drained"),
            ("end, every CTA", ctas, "end")]
    for name, group, slot in rows:
        if group and any(c[slot] for c in group):
            lines.append(f"    {name:34}{spread([us(c, slot) for c in group])}")
    return lines


def report(traces, cases, calls, world, groups=()):
    """Prints the last `calls` launches of each case in `traces`."""
    for case in cases.split(","):
        m, k, n = (int(x) for x in case.split(":")[1:])
        # This case's launches (by the kernel's m, n, k), the last `calls`.
        ids = sorted(i for (i, r), v in traces.items() if r == 0 and (v[0]["m"], v[0]["n"], v[0]["k"]) == (m, n, k))
        for call, i in enumerate(ids[-calls:]):
            per_rank = {r: traces.get((i, r)) for r in range(world)}
            if any(v is None for v in per_rank.values()):
                print(f"== {case} launch {i}: missing a rank's trace")
                continue
            starts = {r: min(c["start"] for c in v if c["start"]) for r, v in per_rank.items()}
            skew = ", ".join(f"rank {r} {(s - starts[0]) / 1e3:+.1f}" for r, s in starts.items() if r)
            print(f"== {case} call {call} (launch {i}): first CTA start by globaltimer, against rank 0: {skew}")
            for r, ctas in per_rank.items():
                # A CTA's flagging warp may set its last flag after the
                # consumers' end stamp.
                end = (max(max(c["end"], c["flagged"]) for c in ctas) - starts[r]) / 1e3
                print(f"  rank {r}: kernel {end:.1f} us (first CTA start to its last end or flag)")
                print("\n".join(summarize(ctas, r, starts[r], groups)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--world", type=int, default=2, help="with --summarize: the traced run's ranks")
    p.add_argument("--groups", default="", help="sizes of the peers' tiles' groups to print apart, e.g. 16,28,24")
    p.add_argument("--in-step", action="store_true", help="start the ranks' kernels together (a GPU barrier first)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out")
    where.add_argument("--summarize", metavar="DIR", help="print the summary of an earlier run's DIR")
    args = p.parse_args()
    groups = [int(x) for x in args.groups.split(",") if x]
    if args.summarize:
        report(read_traces(os.path.join(args.summarize, "trace")), args.cases, args.calls, args.world, groups)
        return
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import symm
    from profile_ops import case_fn, start_ranks

    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, "trace")
    os.environ["SYMM_TRACE_SM90"] = prefix
    os.environ["SYMM_GRAPHS"] = "0"
    os.environ["SYMM_ALGO"] = "fused"
    rank, world, g = start_ranks()
    step = None
    if args.in_step:
        buf = g.create(4096)
        step = buf.rendezvous()
    for case in args.cases.split(","):
        op, m, k, n = case.split(":")
        fn = case_fn(g, op, int(m), int(k), int(n), world, bound=True)
        for _ in range(3):  # warm: workspace, plan, first-use costs (traced too)
            fn()
        for _ in range(args.calls):
            torch.cuda.synchronize()
            dist.barrier()
            if step is not None:
                # Queued behind a sleep, so that the host has queued the call
                # before the barrier lets both GPUs go.
                torch.cuda._sleep(200_000)
                step.barrier(stream=torch.cuda.current_stream().cuda_stream)
            fn()
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        traces = read_traces(prefix)
        print(f"# {world} x {torch.cuda.get_device_name()}, library {symm.__file__}; us from each rank's first CTA start")
        report(traces, args.cases, args.calls, world, groups)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
