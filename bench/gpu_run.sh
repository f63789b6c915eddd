#!/usr/bin/env bash
# One device call: the GPU tests named on the command line (default: all of tests/gpu), results under $OUT.
#   bash bench/gpu_run.sh [pytest args...]
# Needs .wheels/ (bench/gpu_wheels.sh) carried along: the H200 image lacks pydantic.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD BEAMC_GPU_OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -rfE "${@:-tests/gpu}" > $OUT/pytest.txt 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.txt | tail -25
