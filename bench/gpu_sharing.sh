#!/usr/bin/env bash
# Session 7 (bench/NOTES.md run 52): does the decode kernel read a shared prefix once when its
# sharers sit side by side, and the cached VQA run with the page-ordered decode batch (run 52 also
# timed a `group_images` admission option, since removed). Then the GPU tests.
source bench/gpu_setup.sh
timeout 90 python3 bench/gpu_decode_sharing.py 2>&1 | grep -v -i warn | tee $OUT/decode_sharing.log
timeout 300 python3 bench/gpu_cache_timeline.py --configs gpu,off 2>&1 \
  | grep -v -i warn | tee $OUT/timeline.log | grep -E '"(name|wall_s|first_questions_done_s|images_encoded)"|mean_ms|Error|error' | head -60
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_attention.py tests/test_fast_prefix_gpu.py tests/test_fast_gpu.py 2>&1 \
  | grep -v -i "warning\b\|warn(" | tee $OUT/gpu_tests.log | tail -8
