#!/usr/bin/env bash
# One device call: the GPU tests named on the command line (default: all of tests/gpu), results under $OUT.
#   bash bench/gpu_run.sh [pytest args...]
# Needs .wheels/ (bench/gpu_wheels.sh) carried along: the H200 image lacks pydantic.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD BEAMC_GPU_OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
log=$OUT/${PYTEST_LOG:-pytest}.txt  # (PYTEST_LOG: several runs in one call, each its own log)
# (PYTEST_TIMEOUT: seconds before the pytest process is killed, e.g. for kernels never run before that could hang;
# 0, the default: none)
timeout -s KILL ${PYTEST_TIMEOUT:-0} python3 -m pytest -q -p no:cacheprovider -rfE "${@:-tests/gpu}" > $log 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $log | tail -25
