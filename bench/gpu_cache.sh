#!/usr/bin/env bash
# GPU tests of the prefix cache, then the cache benchmark.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "project install failed"; exit 1; }
[ -n "$GPU_TESTS" ] && timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_prefix_gpu.py tests/test_fast_gpu.py 2>&1 \
  | grep -v -i warn | tee $OUT/gpu_tests.log | tail -12
timeout 500 python3 -m wicore.cli.main bench cache --out $OUT 2>&1 | grep -v -i warn | tee $OUT/cache.log | tail -25
