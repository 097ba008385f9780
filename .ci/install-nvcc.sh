#!/usr/bin/env bash
# Install the pinned CUDA 13.0 compiler wheels from PyPI into a project-local
# directory (default: <repo>/.venv/nvcc, git-ignored) and print the path of
# nvcc on the last line of stdout.
#
# Idempotent: a second run with everything in place installs nothing.
# Needs only python3 with pip (Debian: python3-pip) and access to PyPI; no
# venv module, no root. `pip install --target` is used, which PEP 668
# ("externally managed environment") does not block.
#
# Why exactly these versions: PTX produced by a newer nvcc does not load on
# driver 580 (CUDA 13.0), the driver of our GPU machines.
#
# The wheels unpack into one toolkit-shaped tree, <dir>/nvidia/cu13/
# {bin,include,lib,nvvm}; nvcc's own nvcc.profile finds include/ (runtime
# headers, crt/, cccl/), nvvm/bin/cicc and nvvm/libdevice relative to bin/,
# so no environment variables are needed. nvcc still needs a host compiler
# (gcc/g++ on PATH, or NVCC_CCBIN) even for -fatbin.
#
# build.rs finds nvcc here after NVCC, CUDA_HOME and PATH.
#
# Env: SYMM_NVCC_DIR  install directory (default <repo>/.venv/nvcc)
#      PYTHON         interpreter whose pip is used (default python3)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${SYMM_NVCC_DIR:-$repo/.venv/nvcc}"
python="${PYTHON:-python3}"
nvcc="$dir/nvidia/cu13/bin/nvcc"

wheels=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
)

log() { echo "install-nvcc: $*" >&2; }

# True when every pinned wheel is installed at its pinned version
# (pip --target leaves a <name>-<version>.dist-info per wheel).
wheels_present() {
    local spec name version
    for spec in "${wheels[@]}"; do
        name="${spec%%==*}"
        version="${spec##*==}"
        [[ -d "$dir/${name//-/_}-$version.dist-info" ]] || return 1
    done
}

install_wheels() {
    if wheels_present; then
        log "pinned wheels already in $dir"
        return
    fi
    log "installing ${wheels[*]} into $dir"
    mkdir -p "$dir"
    # --upgrade: replace any other version already in the target directory.
    PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --disable-pip-version-check --no-input \
        --no-deps --only-binary=:all: --upgrade --target "$dir" "${wheels[@]}" >&2
}

# Some pip versions drop the executable bit of files in wheels' data.
fix_permissions() {
    local f
    for f in "$dir"/nvidia/cu13/bin/* "$dir"/nvidia/cu13/nvvm/bin/*; do
        if [[ -f "$f" && ! -x "$f" ]]; then
            chmod +x "$f"
        fi
    done
}

main() {
    install_wheels
    fix_permissions
    if ! "$nvcc" --version >/dev/null; then
        log "$nvcc does not run"
        exit 1
    fi
    log "$("$nvcc" --version | grep -o 'release .*')"
    echo "$nvcc"
}

main "$@"
