"""A rank killed with SIGKILL while the fused kernel runs on two GPUs: the
survivor must get an error naming the dead rank within the group's timeout,
nothing may hang, its CUDA context must stay usable, and a new group must
work in the same process.

    python3 bench/gpu/kill_test.py [--timeout-ms 5000] [--calls 400] [--out FILE]

Run from the repository root with bundle/ built (bench/gpu/build-bundle.sh),
on a machine with two GPUs; needs torch. It starts its own two rank
processes (no torchrun): the parent owns the bootstrap store, so the kill
takes only a rank. Steps:

1. both ranks form a CUDA group (timeout --timeout-ms), warm up
   fused_ag_mm forced to the fused kernel (SYMM_ALGO=fused) and check it;
2. both keep calling the fused op; once both made --calls calls, the
   parent kills rank 1 with SIGKILL while the kernels run;
3. rank 0 calls on, looking at Group.health() after each call, until the
   failure is reported (or a call is refused), then
   synchronizes its device (a watchdog fails the test instead of hanging),
   runs a torch matmul, checks that later calls are refused, closes the
   group;
4. the parent starts a fresh rank 1 and both form a new group, whose fused
   call is checked against torch.

Prints `RESULT {json}` with: kill_to_error_s, error_status, error_message,
names_dead_rank, sync_after_error_s, context_usable, later_call_refused,
new_group_ok, new_group_rel_err, pass. Exit 0 on pass, 1 on a failed
check, 3 on a hang (a watchdog fired)."""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
M, K, N = 4096, 4096, 4096  # per-rank rows of A; each fused call takes a few ms


def watchdog(seconds, what):
    """Exits the process with status 3 if not cancelled within `seconds`."""

    def fire():
        print(f"WATCHDOG {what}: still running after {seconds} s", flush=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def env():
    e = dict(os.environ)
    e.setdefault("SYMM_LIBRARY", os.path.join(ROOT, "bundle", "libsymm.so"))
    e["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + e.get("PYTHONPATH", "")
    e["SYMM_ALGO"] = "fused"
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        e[var] = value
    return e


# --- a rank ------------------------------------------------------------------
def operands(rank, torch):
    g = torch.Generator().manual_seed(1234)
    shards = [torch.randn(M, K, generator=g, dtype=torch.float32).to(torch.bfloat16) for _ in range(2)]
    # A K-major B (a Linear weight transposed), as the fused kernel reads it.
    b = (torch.randn(N, K, generator=g, dtype=torch.float32) / K**0.5).to(torch.bfloat16).t()
    ref = (torch.cat(shards).cuda().float() @ b.cuda().float())
    return shards[rank].cuda(), b.cuda(), ref


def fused_call(symm, torch, group, a, b, ref=None):
    out = symm.fused_ag_mm(group, a, b, 0, algorithm="fused")
    if ref is None:
        return None
    torch.cuda.synchronize()
    return ((out.float() - ref).norm() / ref.norm()).item()


def say(line):
    print(line, flush=True)


def rank_main(args):
    import torch

    import symm

    rank = args.rank
    torch.cuda.set_device(rank)
    torch.zeros(1, device="cuda")  # the CUDA context, before the group's timeout starts
    say("STARTED")  # the parent starts the new group's clock only once a fresh rank got here
    uid = bytes.fromhex(args.uid)
    dog = watchdog(120, f"rank {rank} forming the group")
    group = symm.Group.from_unique_id(uid, 2, rank, device=rank, backend="cuda", timeout_ms=args.timeout_ms)
    dog.cancel()
    a, b, ref = operands(rank, torch)
    dog = watchdog(120, f"rank {rank} warm-up")
    err = fused_call(symm, torch, group, a, b, ref)
    dog.cancel()
    say(f"READY rel_err={err:.3g}")
    if args.mode == "fresh":
        ok = err < 2e-2
        say(f"NEWGROUP ok={int(ok)} rel_err={err:.3g}")
        group.close()
        return 0 if ok else 1

    sys.stdin.readline()  # GO
    # Both ranks keep the GPUs busy with fused calls: rank 1 until it is
    # killed, rank 0 until its group reports the failure.
    dog = watchdog(args.timeout_ms / 1000 + 300, f"rank {rank} calling until the failure is reported")
    calls, failure = 0, None
    while failure is None:
        try:
            fused_call(symm, torch, group, a, b)
        except symm.SymmError as e:
            failure = group.health() or e
            break
        calls += 1
        if calls == args.calls:
            say("QUEUED")
        if rank == 0:
            failure = group.health()
    dog.cancel()
    detected = time.time()
    say(f"ERROR t={detected:.6f} status={failure.status_name} message={json.dumps(failure.message)}")
    dog = watchdog(120, "rank 0 synchronizing its device after the failure")
    start = time.monotonic()
    torch.cuda.synchronize()
    synced = time.monotonic() - start
    dog.cancel()
    x = torch.randn(1024, 1024, device="cuda")
    usable = bool(torch.allclose((x @ torch.eye(1024, device="cuda")), x))
    try:
        fused_call(symm, torch, group, a, b)
        refused = False
    except symm.SymmAbortedError:
        refused = True
    dog = watchdog(120, "rank 0 closing the failed group")
    group.close()
    dog.cancel()
    say(f"CLEANUP sync_s={synced:.3f} context_usable={int(usable)} later_call_refused={int(refused)}")

    # A new group in this process, with a fresh rank 1.
    line = sys.stdin.readline().split()  # NEWGROUP <uid>
    args.uid, args.mode = line[1], "fresh"
    return rank_main(args)


# --- the parent ----------------------------------------------------------------
class Rank:
    def __init__(self, rank, uid, args, mode):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--uid", uid.hex(),
               "--timeout-ms", str(args.timeout_ms), "--calls", str(args.calls), "--mode", mode]
        self.rank = rank
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
                                     text=True, env=env(), cwd=ROOT)

    def expect(self, prefix, seconds):
        """The next line starting with `prefix` (others are echoed), or None."""
        deadline = time.monotonic() + seconds
        result = {}

        def read():
            for line in self.proc.stdout:
                line = line.rstrip("\n")
                print(f"[rank {self.rank}] {line}", flush=True)
                if line.startswith(prefix):
                    result["line"] = line
                    return
                if line.startswith("WATCHDOG"):
                    result["watchdog"] = line
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if "watchdog" in result:
            return None
        return result.get("line")

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()


def fields(line):
    """`KEY=VALUE` pairs after the line's first word."""
    out = {}
    for part in line.split(" ")[1:]:
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = v
    return out


def parent(args):
    sys.path.insert(0, os.path.join(ROOT, "python"))
    os.environ.setdefault("SYMM_LIBRARY", os.path.join(ROOT, "bundle", "libsymm.so"))
    import symm

    result = {"timeout_ms": args.timeout_ms, "calls": args.calls, "pass": False}
    ranks = []

    def finish(code, why=None):
        if why:
            result["failure"] = why
        for r in ranks:
            r.kill()
        print("RESULT " + json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return code

    uid = symm.get_unique_id()
    ranks = [Rank(0, uid, args, "kill"), Rank(1, uid, args, "kill")]
    for r in ranks:
        if not r.expect("READY", 300):
            return finish(3, f"rank {r.rank} did not get ready")
    for r in ranks:
        r.send("GO")
    for r in ranks:
        if not r.expect("QUEUED", 300):
            return finish(3, f"rank {r.rank} did not queue its calls")
    time.sleep(0.5)  # the kernels are running on both GPUs
    killed_at = time.time()
    os.kill(ranks[1].proc.pid, signal.SIGKILL)
    ranks[1].proc.wait()
    line = ranks[0].expect("ERROR", args.timeout_ms / 1000 + 150)
    if not line:
        return finish(3, "the survivor reported no error (hung)")
    head, _, message = line.partition(" message=")
    f = fields(head)
    result["kill_to_error_s"] = round(float(f["t"]) - killed_at, 3)
    result["error_status"] = f["status"]
    result["error_message"] = json.loads(message)
    result["names_dead_rank"] = "rank 1" in result["error_message"]
    line = ranks[0].expect("CLEANUP", 300)
    if not line:
        return finish(3, "the survivor hung after the error")
    f = fields(line)
    result["sync_after_error_s"] = float(f["sync_s"])
    result["context_usable"] = f["context_usable"] == "1"
    result["later_call_refused"] = f["later_call_refused"] == "1"

    uid = symm.get_unique_id()
    fresh = Rank(1, uid, args, "fresh")
    ranks.append(fresh)
    # A fresh process takes seconds to import torch and make its context:
    # the survivor joins the new group only once that is done.
    if not fresh.expect("STARTED", 120):
        return finish(3, "the fresh rank 1 did not start")
    ranks[0].send(f"NEWGROUP {uid.hex()}")
    lines = [ranks[0].expect("NEWGROUP", 300), fresh.expect("NEWGROUP", 300)]
    if not all(lines):
        return finish(3, "the new group did not work (hung)")
    result["new_group_ok"] = all(fields(x)["ok"] == "1" for x in lines)
    result["new_group_rel_err"] = float(fields(lines[0])["rel_err"])
    for r in (ranks[0], fresh):
        r.proc.wait(60)
    result["pass"] = bool(
        result["names_dead_rank"]
        and result["kill_to_error_s"] <= args.timeout_ms / 1000 + 5
        and result["context_usable"]
        and result["later_call_refused"]
        and result["new_group_ok"]
    )
    return finish(0 if result["pass"] else 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout-ms", type=int, default=5000)
    p.add_argument("--calls", type=int, default=200, help="calls each rank queues before the kill")
    p.add_argument("--out", help="also write the result JSON here")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--uid", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="kill", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        sys.exit(rank_main(args))
    dog = watchdog(900, "the whole test")
    code = parent(args)
    dog.cancel()
    sys.exit(code)


if __name__ == "__main__":
    main()
