#!/usr/bin/env bash
# Side environment with DeepSpeed, for the DeepSpeed column of benchmarks/bench_engines.py.
#
# Usage: benchmarks/setup_peers.sh [VENV]            (default: $DEEPNVME_PEERS_VENV or /work/venv-peers)
#   PYTHON=python3.11       interpreter the venv is made from (default: python3)
#   TORCH_SPEC=torch==X     torch for the venv (default: the version the base python has, so both
#                           sides of the benchmark run the same torch)
#   DEEPSPEED_SPEC=...      DeepSpeed requirement (default: deepspeed, the newest release)
#   (where packages come from: the usual pip configuration, pip.conf or PIP_* variables)
#
# DeepSpeed never enters deepnvme's own environment: the venv is a clean one (no
# --system-site-packages), torch and DeepSpeed are installed into it from the package index, and
# the script checks at the end that `deepspeed` imports from the venv and not from the base python.
# DeepSpeed is installed with DS_BUILD_OPS=0 (no ops compiled at install); its async_io op is then
# JIT-built once with AsyncIOBuilder().load() (needs libaio-dev, a C++ compiler and ninja) into
# $VENV/torch_extensions, where later loads find it. Run DeepSpeed with that directory as
# TORCH_EXTENSIONS_DIR and $VENV/bin first on PATH (bench_engines.py --ds-python does both): the
# venv's ninja may differ from a system ninja, and a ninja of another version discards the build
# log and recompiles the whole op (minutes). Finally a tensor is written and read back through
# aio_handle as a check, and the shm_comm op that deepspeed.init_distributed loads in every rank
# (CPU accelerator) is built too.
set -euo pipefail

VENV=${1:-${DEEPNVME_PEERS_VENV:-/work/venv-peers}}
PYTHON=${PYTHON:-python3}
DEEPSPEED_SPEC=${DEEPSPEED_SPEC:-deepspeed}

say() { printf '[setup_peers %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { say "error: $*" >&2; exit 1; }

# --- system prerequisites of the async_io op ------------------------------------------------
missing=()
[ -e /usr/include/libaio.h ] || missing+=(libaio-dev)
command -v c++ >/dev/null || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing ${missing[*]} (Debian packages)"
        apt-get install -y -q "${missing[@]}" >/dev/null
    else
        die "missing ${missing[*]}: install them (e.g. apt-get install ${missing[*]}) and re-run"
    fi
fi

if [ -z "${TORCH_SPEC:-}" ]; then
    base_torch=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) \
        || die "$PYTHON has no torch; set TORCH_SPEC=torch==<version>"
    TORCH_SPEC="torch==$base_torch"
fi
if "$PYTHON" -c 'import deepspeed' 2>/dev/null; then
    say "note: the base $PYTHON already imports deepspeed; this venv does not depend on it"
fi

# --- the venv ---------------------------------------------------------------------------------
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV from $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
say "installing $TORCH_SPEC, build tools"
"$VPY" -m pip install -q --upgrade pip setuptools wheel ninja
"$VPY" -m pip install -q "$TORCH_SPEC"
# DeepSpeed ships as an sdist whose setup.py imports torch: build it against the venv's torch
# (no build isolation, which would fetch a second torch), with no ops compiled at install.
say "installing $DEEPSPEED_SPEC (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "$VPY" -m pip install -q --no-build-isolation "$DEEPSPEED_SPEC"

ds_file=$("$VPY" -c 'import deepspeed; print(deepspeed.__file__)' 2>/dev/null | tail -1)
case "$ds_file" in
    "$VENV"/*) ;;
    *) die "deepspeed imports from '$ds_file', not from $VENV" ;;
esac

# --- JIT-build async_io and check a round trip ------------------------------------------------
say "JIT-building DeepSpeed's async_io op (first time: a minute or two)"
export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" PATH="$VENV/bin:$PATH"
check_dir=$(mktemp -d "$VENV/aio-check.XXXXXX")   # O_DIRECT needs a real filesystem, not tmpfs
trap 'rm -rf "$check_dir"' EXIT
"$VPY" - "$check_dir/check.bin" <<'EOF'
import os, sys, torch, deepspeed
from deepspeed.ops.op_builder import AsyncIOBuilder

builder = AsyncIOBuilder()
if not builder.is_compatible(verbose=True):
    sys.exit("AsyncIOBuilder reports it cannot build here (libaio-dev? a compiler?)")
aio = builder.load(verbose=False)
path = sys.argv[1]
handle = aio.aio_handle(1 << 20, 32, False, True, 1)  # block, queue depth, single_submit, overlap_events, threads
n = 8 << 20
src = handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
dst = handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
dst.zero_()
if handle.sync_pwrite(src, path) < 0:
    sys.exit("aio_handle.sync_pwrite failed")
if handle.sync_pread(dst, path) < 0:
    sys.exit("aio_handle.sync_pread failed")
if not torch.equal(src, dst):
    sys.exit("aio_handle read back different bytes")
if os.path.getsize(path) != n:
    sys.exit(f"file size {os.path.getsize(path)} != {n}")
handle.free_cpu_locked_tensor(src)
handle.free_cpu_locked_tensor(dst)
print(f"aio_handle round trip of {n >> 20} MiB OK: deepspeed {deepspeed.__version__}, "
      f"torch {torch.__version__}, {deepspeed.__file__}")
# deepspeed.init_distributed builds the shared-memory collectives op (shm_comm) in every rank
# that starts, when the accelerator offers it (the CPU one does): build it here, once, so that
# ranks started together do not all wait on one compile (minutes on a busy 2-vCPU machine).
from deepspeed.accelerator import get_accelerator
shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
if shm is not None and deepspeed.ops.__compatible_ops__.get(shm.NAME, False):
    shm.load(verbose=False)
    print(f"{shm.NAME} built")
EOF
say "done in $(( $(date +%s) - start )) s; use: python benchmarks/bench_engines.py --ds-python $VPY ..."
