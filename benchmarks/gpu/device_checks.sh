#!/usr/bin/env bash
# The GPU checks of deepnvme, in one unattended run on a CUDA machine (no network needed).
# Usage: OUT=/some/dir bash benchmarks/gpu/device_checks.sh [env] [tests] [bench] [load] [offload]
# Wheels for peers not on the machine (kvikio, fastsafetensors) are installed from ./.whl if present.
# Each phase has its own time limit and writes under $OUT; a failing phase does not stop the others.
set -u
OUT=${OUT:-/tmp/deepnvme-gpu-out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  for w in .whl/*.whl; do  # one at a time: a wheel this Python cannot take skips only itself
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w" || echo "skipped $w"
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
WORK=${WORK:-/tmp/deepnvme-gpu-work}; mkdir -p "$WORK"
phases=${*:-env tests bench load}
for phase in $phases; do
  echo "=== $phase $(date -u +%T)"
  case $phase in
    env)
      { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; uname -r; nproc
        free -g | head -2; df -h "$WORK" | tail -1; lsblk -d -o NAME,SIZE,ROTA,MODEL 2>/dev/null | head
        findmnt -T "$WORK" -o SOURCE,FSTYPE | tail -1; ls /sys/module | grep -i nvidia
        python3 -c "import torch,sys;print(sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda)"
        python3 -m pip list 2>/dev/null | grep -i -E "cuda-bindings|cufile|kvikio|fastsafetensors|safetensors|pytest"
        timeout 40 python3 -m deepnvme report; } > "$OUT/env.txt" 2>&1 ;;
    gdsdiag)
      # cuFile with its defaults; if no file registers, again with a cufile.json allowing (and forcing)
      # compatibility mode, and then keep that configuration for the later phases
      { timeout 40 python3 benchmarks/gpu/cufile_probe.py "$WORK/probe" /dev/shm/deepnvme-probe; rc=$?
        echo "probe rc=$rc"
        if [ $rc -ne 0 ]; then
          printf '{"logging": {"dir": "%s", "level": "INFO"}, "properties": {"allow_compat_mode": true, "force_compat_mode": true}}\n' "$WORK" > "$WORK/cufile.json"
          CUFILE_ENV_PATH_JSON=$WORK/cufile.json timeout 40 python3 benchmarks/gpu/cufile_probe.py "$WORK/probe" /dev/shm/deepnvme-probe \
            && export CUFILE_ENV_PATH_JSON=$WORK/cufile.json && echo "using $CUFILE_ENV_PATH_JSON from here on"
        fi; } > "$OUT/gds-probe.txt" 2>&1
      cat "$OUT/gds-probe.txt" | tail -30 ;;
    tests)
      timeout ${TESTS_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=100 -rs \
        tests/gpu tests/conformance tests/unit/io/test_cufile_counts.py > "$OUT/tests.log" 2>&1
      echo "tests rc=$?" >> "$OUT/tests.log"; tail -5 "$OUT/tests.log" ;;
    bench)
      timeout 90 python3 benchmarks/bench_gpu.py --dir "$WORK" --size 1G --reps 3 --json > "$OUT/bench-gpu.json" 2> "$OUT/bench-gpu.err"
      echo "bench rc=$?"; cat "$OUT/bench-gpu.json" | python3 -c "import json,sys;[print(r) for r in json.load(sys.stdin)['rows']]" ;;
    load)
      timeout ${LOAD_LIMIT:-120} python3 benchmarks/gpu/bench_load_cuda.py --dir "$WORK/load" --gb ${LOAD_GB:-1} --reps ${LOAD_REPS:-2} --json "$OUT/load-cuda.json" 2>&1 | tail -12 ;;
    offload)
      if [ "${OFFLOAD_TESTS:-1}" = 1 ]; then  # (the tests phase runs them too)
        timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_offload_cuda.py > "$OUT/offload-tests.log" 2>&1
        echo "offload tests rc=$?"; tail -3 "$OUT/offload-tests.log"
      fi
      if [ -f benchmarks/gpu/bench_offload_cuda.py ]; then
        timeout ${OFFLOAD_LIMIT:-150} python3 benchmarks/gpu/bench_offload_cuda.py --out "$OUT/offload-cuda.json" --time-limit ${OFFLOAD_TIME:-90} 2>&1 | tail -12
      fi ;;
  esac
done
echo "=== done $(date -u +%T)"
