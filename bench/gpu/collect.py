"""Turns the JSON records a GPU run printed into one results file in the
format of DESIGN.md ("Benchmark results format"), named
<date>-<device-kind>-w<world>-<commit>.json, written into the output folder.

Each rank prints its own record; the file keeps every rank's number and, per
(op, shape, impl), the maximum over ranks as `ms` (or the worst latency)."""
import collections
import datetime
import json
import re
import subprocess
import sys


def gpus(out_dir):
    """(name, driver, count) from run.sh's gpus.txt, else nvidia-smi."""
    try:
        out = open(f"{out_dir}/gpus.txt").read().strip().splitlines()
    except OSError:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()
    names = [l.split(",")[0].strip() for l in out]
    return names[0], out[0].split(",")[1].strip(), len(names)


def main(log, out_dir, commit):
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
            if isinstance(obj, dict) and "op" in obj:
                records.append(obj)
            pos = line.find("{", end)
    if not records:
        print("collect: no records in", log)
        return 0
    name, driver, count = gpus(out_dir)
    # The file is named for the benchmark's world (the world most timings
    # ran at); correctness records of other worlds keep theirs per record.
    worlds = collections.Counter(r.get("world", 1) for r in records if "ms" in r) or \
        collections.Counter(r.get("world", 1) for r in records)
    world = worlds.most_common(1)[0][0]
    date = datetime.date.today().isoformat()
    # "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200.
    model = next((w for w in name.split() if re.fullmatch(r"[A-Z]+\d{2,4}[A-Za-z]*", w)), name.split()[-1])
    kind = f"{model.lower()}-x{count}"
    merged = {}
    for r in records:
        key = (r["op"], tuple(r["shape"]), r["impl"], r.get("world", 1))
        merged.setdefault(key, []).append(r)
    out = []
    for (op, shape, impl, w), rs in sorted(merged.items()):
        rec = {"op": op, "shape": list(shape), "dtype": rs[0].get("dtype", "bytes"), "impl": impl,
               "world": w, "iters": rs[0].get("iters")}
        for field in ("ms", "us_per_barrier"):
            if field in rs[0]:
                rec[field] = max(r[field] for r in rs)
                rec[field + "_per_rank"] = [r[field] for r in sorted(rs, key=lambda r: r.get("rank", 0))]
        if "relerr" in rs[0]:
            rec["relerr"] = max(r["relerr"] for r in rs)
        if "GBps" in rs[0]:
            rec["GBps"] = min(r["GBps"] for r in rs)
        out.append(rec)
    result = {"device": name, "device_count": count, "world_size": world, "date": date,
              "commit": commit, "driver": driver, "records": out}
    path = f"{out_dir}/{date}-{kind}-w{world}-{commit}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("collect: wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
