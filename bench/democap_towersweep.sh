#!/usr/bin/env bash
# Session 3 sweep of tower probes (bench/democap_towerprobe.py) on the GPU machine, in parallel.
# Steps per config: what a 2-core CPU affords in ~15 min at that size (measured locally).
source bench/gpu_setup.sh
export CUBLAS_WORKSPACE_CONFIG=:4096:8
mkdir -p /tmp/tsweep
run() {  # name, args...
  name=$1; shift
  timeout 480 python3 bench/democap_towerprobe.py --device cuda --threads 1 --valid 1000 --name $name "$@" \
    > /tmp/tsweep/$name.log 2>&1 &
}
run r128     --size 128 --patch 16 --steps 4000
run r128g    --size 128 --patch 16 --steps 4000 --init gemma
run r128m    --size 128 --patch 16 --steps 4000 --init siglip+mim
run r128w    --size 128 --patch 16 --steps 3000 --width 128 --heads 4
run r128lr4  --size 128 --patch 16 --steps 4000 --lr 4e-3
run r96p8    --size 96 --patch 8 --steps 3600
run r96p12   --size 96 --patch 12 --steps 5000
run r128p8   --size 128 --patch 8 --steps 1300
run r160     --size 160 --patch 16 --steps 2400
run r128L6   --size 128 --patch 16 --steps 3200 --layers 6
run r128b128 --size 128 --patch 16 --steps 2200 --batch 128
wait
cat /tmp/tsweep/*.log | grep -v '^{' | tail -20
grep -h valid_acc /tmp/tsweep/*.log > $OUT/towersweep.jsonl
cat $OUT/towersweep.jsonl
nvidia-smi --query-gpu=name --format=csv
