#!/usr/bin/env bash
# The Python packages beamc needs that the H200 image lacks (pydantic and its deps), as py3.12 wheels in .wheels/,
# to carry to the device machine. There, before the tests or benchmarks:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.wheels/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.wheels/" >> .git/info/exclude; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .wheels \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
ls .wheels
