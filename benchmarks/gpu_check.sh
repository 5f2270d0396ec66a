#!/usr/bin/env bash
# Everything a GPU machine should check, in one command (docs/gpus.md, "On a GPU machine"):
#
#   OUT=/some/folder bash benchmarks/gpu_check.sh           # about 11 minutes on one H100 / H200
#   OUT=/tmp/out bash benchmarks/gpu_check.sh --smoke       # the same parts in a minute on a CPU machine
#
# 1. installs the wheels carried in .whl/ (what the GPU machine lacks: torchdata, attrs, cattrs,
#    hypothesis, DeepSpeed and its dependencies, scikit-learn, ...; see docs/gpus.md) into /tmp/site,
#    and this checkout with the example callback package, without network;
# 2. runs the README's test command's pytest, the whole suite (with pytest-xdist when present),
#    junit and log under $OUT;
# 3. runs the CUDA tests alone (-m cuda), verbose;
# 4. runs benchmarks/gpu.py --json $OUT/gpu.json.
#
# Each part has its own time limit (SUITE_S, CUDA_S, BENCH_S seconds) and the next part runs even if
# one fails; the exit status is non-zero when any part failed. $OUT/summary.txt says which.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
PY="$(command -v python3 || command -v python)"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 WANDB_MODE=offline
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/cadence-inductor}"
SITE="${SITE:-/tmp/site}"
WHEELS=(.whl/*.whl)
if [ "$SMOKE" = 1 ]; then  # a CPU machine with its own venv: the install's mechanics, pure-Python wheels only
    SITE="$OUT/site"
    WHEELS=(.whl/*-none-any.whl)
fi
status=0
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

# -- 1. the environment ---------------------------------------------------------------------------
if [ -e "${WHEELS[0]}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS[@]}" \
        > "$OUT/pip.log" 2>&1 || summary "carried wheels: pip failed (see pip.log)"
else
    summary "no wheels in .whl/: nothing carried (see docs/gpus.md for the download command)"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
# Cadence and the example package installed (their entry points are what plugin discovery reads);
# where setuptools is missing, this checkout is imported through PYTHONPATH as it is.
if [ "$SMOKE" = 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . ./examples/cadence-gradstats \
        >> "$OUT/pip.log" 2>&1 || summary "cadence not installed into $SITE (see pip.log): imported from the checkout"
fi
{
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
    "$PY" - <<'EOF'
import importlib.util
wanted = ["torchdata", "attrs", "cattrs", "hypothesis", "deepspeed", "torchmetrics", "tensorboard", "sklearn",
          "matplotlib", "wandb", "torchft", "submitit", "nbclient", "ipykernel", "mkdocs", "xdist", "pytest_timeout",
          "torchao"]
missing = [name for name in wanted if importlib.util.find_spec(name) is None]
print("missing here (their tests skip or fail):", missing or "none")
EOF
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
} 2>&1 | tee "$OUT/environment.txt"

run_part() {  # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    local started=$SECONDS
    timeout --signal=TERM --kill-after=15 "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && summary "$name: TIMED OUT after ${seconds} s"
    [ "$rc" -ne 0 ] && status=1
    summary "$name: exit $rc in $((SECONDS - started)) s; $(tail -n 1 "$OUT/$name.log")"
}

# -- 2. the suite, as the README runs it ------------------------------------------------------------
xdist=()
if "$PY" -c "import xdist" 2> /dev/null; then
    xdist=(-n "${WORKERS:-12}")
fi
if [ "$SMOKE" = 1 ]; then
    run_part suite "${SUITE_S:-300}" "$PY" -m pytest -p no:cacheprovider -q --junitxml="$OUT/junit-suite.xml" \
        tests/backends/test_device.py tests/engine/test_placement.py tests/callbacks/test_memory.py
else
    run_part suite "${SUITE_S:-240}" "$PY" -m pytest -p no:cacheprovider -q -rfEs "${xdist[@]}" \
        --junitxml="$OUT/junit-suite.xml"
fi

# -- 3. the CUDA tests alone ----------------------------------------------------------------------------
run_part cuda "${CUDA_S:-180}" "$PY" -m pytest -p no:cacheprovider -v -rfEs -m cuda --junitxml="$OUT/junit-cuda.xml"

# -- 4. the benchmark -------------------------------------------------------------------------------------
if [ "$SMOKE" = 1 ]; then
    run_part benchmark "${BENCH_S:-120}" "$PY" benchmarks/gpu.py --smoke --json "$OUT/gpu.json"
else
    # float8 compiles three models (issue 35): about 2 minutes more than the other parts.
    run_part benchmark "${BENCH_S:-300}" "$PY" benchmarks/gpu.py --rounds 3 --block 10 --json "$OUT/gpu.json"
fi
summary "overall: $([ "$status" = 0 ] && echo passed || echo FAILED); logs and junit in $OUT"
exit "$status"
