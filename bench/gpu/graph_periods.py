"""Time per call in lock step, from `profile_ops.py --graph N --calls 1`
output: each case's profiled replay holds N calls of the same kernels and
copies, so its activities (in start order) split into N equal runs; the
first call, which absorbs the ranks' start skew, is left out, and the rest
divided by N - 1. The slowest rank's is printed, per case, in us.
    python3 bench/gpu/graph_periods.py profile.txt
"""
import argparse
import re

HEAD = re.compile(r"== (\S+) rank (\d+): last call \(each a graph of (\d+)\)")
ACTIVITY = re.compile(r"\s+\+\s*([\d.]+) ms\s+([\d.]+) ms\s+")


def periods(lines):
    """{case: [us per call, per rank]} of a profile_ops --graph output."""
    timelines, current = {}, None
    for line in lines:
        head = HEAD.match(line)
        if head:
            current = (head.group(1), int(head.group(2)), int(head.group(3)))
            timelines[current] = []
            continue
        activity = ACTIVITY.match(line)
        if activity and current:
            timelines[current].append((float(activity.group(1)), float(activity.group(2))))
    out = {}
    for (case, _, calls), spans in timelines.items():
        spans.sort()
        if calls < 2 or len(spans) % calls:
            raise ValueError(f"{case}: {len(spans)} activities are not {calls} equal calls")
        second = spans[len(spans) // calls][0]
        end = max(start + length for start, length in spans)
        out.setdefault(case, []).append((end - second) / (calls - 1) * 1e3)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("profile")
    args = p.parse_args()
    for case, per_rank in periods(open(args.profile)).items():
        print(f"{case:40s} {max(per_rank):8.1f} us  (ranks: {', '.join(f'{v:.1f}' for v in per_rank)})")


if __name__ == "__main__":
    main()
