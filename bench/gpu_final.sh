#!/usr/bin/env bash
# The caption benchmark (product defaults), then one product-path run with other engine settings.
source bench/gpu_setup.sh
timeout 400 python3 -m wicore.cli.main bench caption --images 1024 --out $OUT --workdir /tmp/wb 2>&1 \
  | grep -v -i warn | tee $OUT/bench.log | tail -20
cp /tmp/wb/worker.log $OUT/ 2>/dev/null
[ -n "$1" ] && timeout 170 python3 bench/product_only.py 1024 "$1" "$2" 2>&1 | grep -v -i warn | tail -3
