#!/usr/bin/env bash
# Session 7, run 55 (bench/NOTES.md): do the long host stalls of some launches (a 14-image vision
# batch held the host 807 ms, a prefill 392 ms in run 54) come from the caching allocator
# (cudaMalloc failing next to the KV pool, then freeing its cache: a device-wide sync)? The
# timeline with the default allocator, then with expandable segments.
source bench/gpu_setup.sh
for conf in "" "expandable_segments:True"; do
  echo "== PYTORCH_CUDA_ALLOC_CONF=$conf"
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout 280 python3 bench/gpu_cache_timeline.py --configs gpu,off 2>&1 \
    | grep -v -i warn | tee -a $OUT/timeline.log \
    | grep -E '"(name|wall_s|add_s|first_launch_s|num_device_alloc|num_device_free|num_alloc_retries|num_sync_all_streams|reserved_gib)"|Error|error' | head -30
  label=default; [ -n "$conf" ] && label=expandable
  mv $OUT/cache_timeline.json "$OUT/cache_timeline-$label.json"
done
