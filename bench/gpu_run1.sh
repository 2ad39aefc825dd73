#!/usr/bin/env bash
# GPU run: install the carried wheels and the project, run the GPU tests, then the caption benchmark.
# Usage on the device machine (carry .whl): bash bench/gpu_run1.sh [extra bench args]
source bench/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_gpu.py tests/test_ops_attention.py 2>&1 \
  | tee $OUT/gpu_tests.log | tail -25
timeout 450 python3 -m wicore.cli.main bench caption --images 1024 --out $OUT --workdir /tmp/wb "$@" 2>&1 \
  | tee $OUT/bench.log | tail -45
cp /tmp/wb/worker.log $OUT/ 2>/dev/null
