#!/usr/bin/env bash
# The GPU checks of `alpac calibrate` and `alpa-run` on one NVIDIA GPU
# (benchmarks/results/gpu_<name>/):
#   1. alpac calibrate on the GPU (-- np 1) -> OUT/gpu-calibrated.yaml, and --check of it
#   2. testdata training steps compiled for that file and run by alpa-run --check --report,
#      one rank on the GPU, and a two-stage pipeline of two ranks sharing it (MPI between
#      the stages); alpac explain --against each run (bench_gpu_fidelity.py --run; the same
#      script, without --run, prices the committed reports for the cost model of the day).
#   3. the rounding floor of --check (gpu_rounding.py): the original modules on the GPU against
#      the CPU after 1 and ITERS steps; the microbatched plans checked after one step, and on
#      the CPU against the CPU's reference.
# Usage: benchmarks/gpu_check.sh OUT [WHEELS]   (WHEELS: a folder of wheels to install first,
# for a machine whose Python lacks alpac's dependencies. ALPAC_PLATFORM=cpu
# CALIBRATE_OPTIONS=--quick tries it on CPU; ITERS=N runs each plan N iterations, default 6;
# CALIBRATED=FILE skips step 1 and compiles for that file.)
set -u
OUT=$(realpath "${1:?usage: gpu_check.sh OUT [WHEELS]}")
WHEELS=${2:-}
PLATFORM=${ALPAC_PLATFORM:-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
exec > >(tee -a "$OUT/log.txt") 2>&1

if [ -n "$WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/alpac-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/alpac-site${PYTHONPATH:+:$PYTHONPATH}
  # pip --target keeps the mpich wheel's programs but not its library: taken from the wheel
  $PY -c "import glob, os, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/mpich-*.whl')[0])
for i in z.infolist():  # its libraries and theirs (lib/mpich/), not the links (tiny files)
    rest = i.filename.partition('.data/data/lib/')[2]
    if rest and not i.is_dir() and i.file_size > 100:
        os.makedirs(os.path.dirname('/tmp/alpac-site/lib/' + rest), exist_ok=True)
        open('/tmp/alpac-site/lib/' + rest, 'wb').write(z.read(i))" "$WHEELS" || exit 1
  export LD_LIBRARY_PATH=/tmp/alpac-site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  chmod +x /tmp/alpac-site/bin/* && MPIEXEC="--mpiexec /tmp/alpac-site/bin/mpiexec"
  # mpi4py's wheel loads whichever MPI it finds first: the image's Open MPI, not MPICH's
  export MPI4PY_LIBMPI=/tmp/alpac-site/lib/libmpi.so.12 MPI4PY_MPIABI=mpich
fi
if ! $PY -c "import alpac.runtime.launcher" 2>/dev/null; then
  # the installed layout (passes/ and runtime/ as alpac.passes, alpac.runtime) without pip
  rm -rf /tmp/alpac-src && mkdir -p /tmp/alpac-src && cp -r alpac /tmp/alpac-src/ &&
    cp -r passes /tmp/alpac-src/alpac/passes && cp -r runtime /tmp/alpac-src/alpac/runtime
  export PYTHONPATH=/tmp/alpac-src${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONSAFEPATH=1  # not the checkout's alpac/ (without passes/ and runtime/ in it)
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # two ranks share the one GPU in step 2
ALPAC="$PY -m alpac.cli"

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
$PY -c "import jax, jaxlib, sys; print(sys.version.split()[0], 'jax', jax.__version__,
'jaxlib', jaxlib.__version__, jax.devices())"

if [ -n "${CALIBRATED:-}" ]; then
  CLUSTER=$(realpath "$CALIBRATED")
  echo "== 1. calibrate: skipped, $CLUSTER"
else
  echo "== 1. calibrate"
  CLUSTER=$OUT/gpu-calibrated.yaml
  time timeout 300 $ALPAC calibrate ${MPIEXEC:-} ${CALIBRATE_OPTIONS:-} --platform "$PLATFORM" \
    -o "$CLUSTER" -- np 1
  if [ ! -f "$CLUSTER" ]; then echo "calibration failed: nothing else runs"; exit 1; fi
  time timeout 120 $ALPAC calibrate ${MPIEXEC:-} --platform "$PLATFORM" --check "$CLUSTER" -- np 1
fi

echo "== 2. alpa-run --check with the calibrated file"
PYTHONPATH=benchmarks${PYTHONPATH:+:$PYTHONPATH} timeout 1200 $PY benchmarks/bench_gpu_fidelity.py \
  --run "$OUT" --cluster "$CLUSTER" --platform "$PLATFORM" --iters "${ITERS:-6}" ${MPIEXEC:-}
echo "== 3. rounding: the original modules on the GPU against the CPU"
timeout 300 $PY benchmarks/gpu_rounding.py testdata/models/{mlp,gpt,bert,moe,wresnet}_train.hlo \
  --iters 1 "${ITERS:-6}" --json "$OUT/rounding.json"
for case in gpt_train_mb4:1 gpt_train_pp2:2; do
  for how in "--platform $PLATFORM --iters 1" "--platform cpu --iters ${ITERS:-6}"; do
    echo "-- ${case%:*}: alpa-run --check $how"
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 120 $PY -m alpac.runtime.launcher \
      "$OUT/plans/${case%:*}" ${MPIEXEC:-} --check $how \
      -- np "${case#*:}" 2>&1 | grep -A1 "check\|Error"
  done
done
echo "== done"
