#!/usr/bin/env bash
# Recipe sweep for the demo captioner on the GPU machine: each config trains for the number of
# steps a 2-core CPU affords in ~22 minutes (measured locally), curves of held-out exact match.
set -o pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "project install failed"; exit 1; }
mkdir -p /tmp/sweep
run() {  # name, args...
  name=$1; shift
  timeout 540 python3 -m wicore.models.democap.train --out /tmp/sweep/$name --device cuda --eval-every 400 "$@" \
    > /tmp/sweep/$name.log 2>&1 &
}
S64="--image-size 64 --patch-size 8 --vision-width 64 --vision-heads 2 --vision-mlp 128"
T64="--text-width 64 --text-mlp 128 --text-heads 2"
S64="--image-size 64 --patch-size 8 --vision-width 64 --vision-heads 2 --vision-mlp 128 --image-tokens 64"
T64="--text-width 64 --text-mlp 128 --text-heads 2"
run f_b128    $S64 $T64 --lr 0.002 --steps 2400 --batch-size 128
run g_b96     $S64 $T64 --lr 0.002 --steps 3200
run h_dense2  $S64 $T64 --lr 0.002 --steps 3200 --dense-weight 2 --aux-weight 1
run i_w96     --image-size 64 --patch-size 8 --vision-width 96 --vision-heads 3 --vision-mlp 192 --image-tokens 64 $T64 --lr 0.002 --steps 2800
run j_lr3     $S64 $T64 --lr 0.003 --steps 3200
wait
python3 - <<'PY'
import json, glob, os
out = {}
for log in sorted(glob.glob("/tmp/sweep/*.log")):
    name = os.path.basename(log)[:-4]
    rows = [eval(l) for l in open(log) if l.startswith("{'step'")]
    out[name] = rows
    print(name, [(r["step"], r["valid_exact_match"], r["s"]) for r in rows])
    if not rows:
        print(open(log).read()[-2000:])
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/sweep.json", "w"), indent=1)
PY
nvidia-smi --query-gpu=name --format=csv
