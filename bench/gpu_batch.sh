#!/usr/bin/env bash
# Session 7, run 54 (bench/NOTES.md): the cached VQA run at 384 and 768 sequences in flight, and
# "off" at 768 (its 384 is runs 50-53), with the faster prefix keys; when each run's first launch
# happens (engine.add of 1,024 requests before it).
source bench/gpu_setup.sh
timeout 400 python3 bench/gpu_cache_timeline.py --configs gpu,gpu,off --batch-sizes 384,768,768 2>&1 \
  | grep -v -i warn | tee $OUT/timeline.log | grep -E '"(name|wall_s|add_s|first_launch_s|first_questions_done_s)"|Error|error' | head -40
