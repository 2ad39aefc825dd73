#!/usr/bin/env bash
# GPU tests of the prefix cache, then the cache benchmark.
source bench/gpu_setup.sh
[ -n "$GPU_TESTS" ] && timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_attention.py tests/test_fast_prefix_gpu.py tests/test_fast_gpu.py 2>&1 \
  | grep -v -i "warning\b\|warn(" | tee $OUT/gpu_tests.log | tail -12
timeout 585 python3 -m wicore.cli.main bench cache --out $OUT 2>&1 | grep -v -i warn | tee $OUT/cache.log | tail -25
