#!/usr/bin/env bash
# Checks build.rs's kernel cache end to end with a fake nvcc, in seconds: the
# build script is compiled alone and run the way cargo runs it, on a scratch
# crate whose kernels/ it may edit. What it checks: one compile per unit,
# none when another profile or a rerun finds the cache, only the changed unit
# recompiled, any header / nvcc flag / nvcc version recompiling all, an
# explicit SYMM_KERNEL_CACHE, compile errors failing without leaving entries,
# the no-nvcc and too-new-nvcc paths, and two concurrent builds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

rustc --edition 2021 -O --crate-name build_script_build "$repo/build.rs" -o "$tmp/build-script" 2>&1

# The fake nvcc: `--version` says $FAKE_NVCC_VERSION; a compile logs the
# unit, writes a fatbin-magic file slowly (so a torn read would show) and
# fails on `#error`.
mkdir -p "$tmp/bin"
cat >"$tmp/bin/nvcc" <<'NVCC'
#!/usr/bin/env bash
if [[ "$1" == --version ]]; then
    echo "Cuda compilation tools, release ${FAKE_NVCC_VERSION%.*}, V$FAKE_NVCC_VERSION"
    exit 0
fi
out=; while [[ $# -gt 1 ]]; do [[ "$1" == -o ]] && out="$2"; shift; done
echo "$(basename "$1")" >>"$FAKE_NVCC_LOG"
if grep -q '#error' "$1"; then echo "$1: error" >&2; exit 2; fi
printf '\x50\xed\x55\xba' >"$out"; sleep 0.2; cat "$1" >>"$out"
NVCC
chmod +x "$tmp/bin/nvcc"

crate="$tmp/crate"
mkdir -p "$crate/kernels"
echo 'A' >"$crate/kernels/a.cu"
echo 'B' >"$crate/kernels/b.cu"
echo 'H' >"$crate/kernels/h.cuh"
target="$tmp/target"
mkdir -p "$target" && touch "$target/CACHEDIR.TAG"

export NVCC="$tmp/bin/nvcc" FAKE_NVCC_VERSION=13.0.88 FAKE_NVCC_LOG="$tmp/nvcc.log"
unset SYMM_KERNEL_CACHE CARGO_TARGET_DIR NVCC_APPEND_FLAGS NVCC_PREPEND_FLAGS NVCC_CCBIN SYMM_REQUIRE_NVCC

fails=0
check() { # what, condition...
    local what="$1"; shift
    if "$@"; then echo "ok   $what"; else echo "FAIL $what" >&2; fails=$((fails + 1)); fi
}

# Runs the build script for profile $1 as cargo would; prints the units
# nvcc compiled, sorted; returns the script's status.
build() {
    local out="$target/$1/build/symm-0/out" rc=0
    mkdir -p "$out"
    : >"$FAKE_NVCC_LOG"
    (cd "$crate" && CARGO_MANIFEST_DIR="$crate" OUT_DIR="$out" NUM_JOBS=2 "$tmp/build-script") \
        >"$tmp/stdout" 2>"$tmp/stderr" || rc=$?
    sort "$FAKE_NVCC_LOG" | tr '\n' ' '
    return $rc
}
fails() { ! "$@" >/dev/null; }
entries() { find "${1:-$target/symm-kernels}" -name '*.fatbin' | wc -l; }

check "first build compiles each unit" test "$(build release)" = "a.cu b.cu "
check "  sets cfg(symm_fatbin)" grep -q 'cargo::rustc-cfg=symm_fatbin' "$tmp/stdout"
check "  lists both fatbins" test "$(grep -c 'FATBIN_[0-9]),' "$target/release/build/symm-0/out/symm_kernel_fatbins.rs")" = 2
check "  caches them in <target>/symm-kernels" test "$(entries)" = 2
check "another profile compiles nothing" test "$(build debug)" = ""
check "  and embeds the same fatbins" cmp -s "$target/debug/build/symm-0/out/symm_kernel_fatbins.rs" \
    <(sed 's/release/debug/' "$target/release/build/symm-0/out/symm_kernel_fatbins.rs")
check "a rerun compiles nothing" test "$(build release)" = ""

echo 'B2' >"$crate/kernels/b.cu"
check "a changed unit recompiles alone" test "$(build release)" = "b.cu "
echo 'H2' >"$crate/kernels/h.cuh"
check "a changed header recompiles all" test "$(build release)" = "a.cu b.cu "
check "NVCC_APPEND_FLAGS recompiles all" test "$(NVCC_APPEND_FLAGS=-DX build release)" = "a.cu b.cu "
check "another nvcc version recompiles all" test "$(FAKE_NVCC_VERSION=13.0.99 build release)" = "a.cu b.cu "
check "SYMM_KERNEL_CACHE is used" test "$(SYMM_KERNEL_CACHE="$tmp/shared" build release)" = "a.cu b.cu "
check "  and holds the entries" test "$(entries "$tmp/shared")" = 2

echo '#error' >"$crate/kernels/a.cu"
check "a compile error fails the build" fails build release
check "  naming the unit" grep -q 'compiling kernels/a.cu' "$tmp/stderr"
check "  leaving no temporary file" test -z "$(find "$target/symm-kernels" -name '*.tmp')"
echo 'A' >"$crate/kernels/a.cu"

check "no nvcc: nothing compiled" test "$(NVCC=/nonexistent build release)" = ""
check "  no cfg(symm_fatbin)" test -z "$(grep 'rustc-cfg=symm_fatbin' "$tmp/stdout")"
check "  an empty fatbin list" grep -q '&\[$' "$target/release/build/symm-0/out/symm_kernel_fatbins.rs"
required_missing() { SYMM_REQUIRE_NVCC=1 NVCC=/nonexistent build release; }
required_too_new() { SYMM_REQUIRE_NVCC=1 FAKE_NVCC_VERSION=13.1.0 build release; }
check "  SYMM_REQUIRE_NVCC=1 fails" fails required_missing
check "nvcc 13.1 with SYMM_REQUIRE_NVCC=1 fails" fails required_too_new

# Two builds at once on an empty cache both succeed with complete entries.
rm -rf "$target/symm-kernels"
build p1 >/dev/null & build p2 >/dev/null & wait
ok=true
for f in "$target"/symm-kernels/*.fatbin "$target"/p{1,2}/build/symm-0/out/*.fatbin; do
    [[ "$(tail -c +5 "$f")" == A || "$(tail -c +5 "$f")" == B2 ]] || ok=false
done
check "concurrent builds leave complete entries" $ok
check "  and no temporary file" test -z "$(find "$target/symm-kernels" -name '*.tmp')"

if ((fails)); then
    echo "$fails kernel cache check(s) failed" >&2
    exit 1
fi
echo "kernel cache: all checks passed"
