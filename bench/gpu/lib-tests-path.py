"""Reads `cargo test --lib --no-run --message-format=json` on stdin and
prints the path of the library's unit-test executable (build-bundle.sh and
build-baseline.sh carry it to the GPU machine)."""
import json
import sys

path = None
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "rlib" in m["target"]["kind"]:
        path = m["executable"]
if path is None:
    sys.exit("no unit-test executable in cargo's output")
print(path)
