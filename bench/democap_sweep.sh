#!/usr/bin/env bash
# Recipe sweep for the demo captioner on the GPU machine: each config runs train.py (both stages)
# for the steps a 2-core CPU affords in < 30 minutes (measured locally), several in parallel.
source bench/gpu_setup.sh
export CUBLAS_WORKSPACE_CONFIG=:4096:8
mkdir -p /tmp/sweep
run() {  # name, args...
  name=$1; shift
  timeout ${SWEEP_TIMEOUT:-560} python3 -m wicore.models.democap.train --out /tmp/sweep/$name --device cuda --threads 1 \
    --eval-every 400 "$@" > /tmp/sweep/$name.log 2>&1 &
}
# run 21 (bench/NOTES.md): train.py's defaults and neighbours at the steps the CPU affords
run i1_default
run i2_lr5       --vision-lr 0.005
run i3_b96       --vision-batch-size 96 --vision-steps 3900
run j1_s900      --vision-steps 2600 --steps 900
run j2_lr4       --lr 0.004
run j4_pool20k   --pool 20000
run j5_seed1     --seed 1
wait
python3 - <<'PY'
import json, glob, os
out = {}
for log in sorted(glob.glob("/tmp/sweep/*.log")):
    name = os.path.basename(log)[:-4]
    rows = [eval(l) for l in open(log) if l.startswith("{'")]
    out[name] = rows
    print(name, [(r.get("vision_step"), r.get("probe_shape_accuracy")) for r in rows if "vision_step" in r][-4:])
    print(name, [(r["step"], r["valid_exact_match"], r["s"]) for r in rows if "step" in r])
    if not rows:
        print(open(log).read()[-2000:])
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/sweep.json", "w"), indent=1)
PY
nvidia-smi --query-gpu=name --format=csv
