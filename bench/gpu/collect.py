"""Turns the JSON records a GPU run printed into one results file in the
format of DESIGN.md ("Benchmark results format"), named
<date>-<device-kind>-w<world>-<commit>.json, written into the output folder.

Each rank prints its own record; the file keeps every rank's number and, per
(op, shape, dtype, impl, world, quantity), the maximum over ranks as `ms`
(or the worst latency, or the most host time).

A committed log can be collected again (say after a fix here) with its run's
date: `collect.py LOG OUT_DIR COMMIT [DATE]`; the GPUs are then read from the
log's first lines (run.sh's nvidia-smi query) when OUT_DIR has no gpus.txt."""
import collections
import datetime
import json
import re
import subprocess
import sys


# What a record measures, in the order looked for: a record of host time
# (host_overhead.py) shares op, shape and impl with the timing of the same
# implementation and must not be merged into it.
QUANTITIES = ("ms", "us_per_barrier", "host_us", "GBps")
# Fields that tell cases of one op, shape and dtype apart (bench_families.py's
# records: the family, a 3-D activation's batch, fp8 scales; bench_hosts.py's:
# NCCL's transport, the pretend hosts), kept as they are.
LABELS = ("family", "batch", "scales", "transport", "hosts")


def gpus(out_dir, log):
    """(name, driver, count) from run.sh's gpus.txt, else the log's
    nvidia-smi lines, else nvidia-smi."""
    try:
        # checks.sh adds a line naming the commit.
        out = [l for l in open(f"{out_dir}/gpus.txt").read().splitlines() if re.match(r"[^,]+, \d+\.\d+", l)]
    except OSError:
        out = [l for l in open(log).read().splitlines()[:16] if re.match(r"NVIDIA .*, \d+\.\d+", l)]
    if not out:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()
    names = [l.split(",")[0].strip() for l in out]
    return names[0], out[0].split(",")[1].strip(), len(names)


def quantity(r):
    return next((q for q in QUANTITIES if q in r), None)


def main(log, out_dir, commit, date=None):
    # Ranks print concurrently, so one line may hold several records (or a
    # record and other text): decode every JSON object found on each line.
    records, decoder = [], json.JSONDecoder()
    for line in open(log):
        pos = line.find("{")
        while pos != -1:
            try:
                obj, end = decoder.raw_decode(line, pos)
            except json.JSONDecodeError:
                pos = line.find("{", pos + 1)
                continue
            # Timings only: the library tests' host-time lines name no shape.
            if isinstance(obj, dict) and "op" in obj and "shape" in obj:
                records.append(obj)
            pos = line.find("{", end)
    if not records:
        print("collect: no records in", log)
        return 0
    name, driver, count = gpus(out_dir, log)
    # The file is named for the benchmark's world (the world most timings
    # ran at); correctness records of other worlds keep theirs per record.
    # Records that name no world (the single-GPU matmul lines) do not count.
    worlds = collections.Counter(r["world"] for r in records if "ms" in r and "world" in r) or \
        collections.Counter(r.get("world", 1) for r in records)
    world = worlds.most_common(1)[0][0]
    date = date or datetime.date.today().isoformat()
    # "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200.
    model = next((w for w in name.split() if re.fullmatch(r"[A-Z]+\d{2,4}[A-Za-z]*", w)), name.split()[-1])
    kind = f"{model.lower()}-x{count}"
    merged = {}
    for r in records:
        key = (r["op"], tuple(r["shape"]), r.get("dtype", "bytes"), r["impl"], r.get("world", 1), quantity(r),
               tuple((f, r[f]) for f in LABELS if f in r))
        merged.setdefault(key, []).append(r)
    out = []
    for (op, shape, dtype, impl, w, q, labels), rs in sorted(merged.items(), key=lambda kv: repr(kv[0])):
        rec = {"op": op, "shape": list(shape), "dtype": dtype, "impl": impl, "world": w, "iters": rs[0].get("iters")}
        rec.update(labels)
        if "bytes" in rs[0]:
            rec["bytes"] = rs[0]["bytes"]
        by_rank = sorted(rs, key=lambda r: r.get("rank", 0))
        for field in ("ms", "us_per_barrier", "host_us", "library_us", "python_us", "torch_matmul_host_us"):
            if field in rs[0]:
                rec[field] = max(r[field] for r in rs)
                rec[field + "_per_rank"] = [r[field] for r in by_rank]
        if "relerr" in rs[0]:
            rec["relerr"] = max(r["relerr"] for r in rs)
        if "GBps" in rs[0]:
            rec["GBps"] = min(r["GBps"] for r in rs)
        out.append(rec)
    result = {"device": name, "device_count": count, "world_size": world, "date": date,
              "commit": commit, "driver": driver, "records": out}
    # A run of bench_families.py or bench_hosts.py alone is named apart from a full run's.
    suffix = "-families" if all("family" in r for r in records) else \
        "-hosts" if all(r["op"].startswith("hosts_") for r in records) else ""
    path = f"{out_dir}/{date}-{kind}-w{world}-{commit}{suffix}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("collect: wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
