#!/usr/bin/env bash
# Shape-only probes of the SigLIP tower (recipe search for the demo captioner), 8 in parallel.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "project install failed"; exit 1; }
p() { timeout 420 python3 bench/democap_vitprobe.py "$@" > /tmp/$1.log 2>&1 & }
#  name        lr    steps S   P  W   L  B   curriculum
p base        1e-3  6000  64  8  128 4  96  0
p lr3e-4      3e-4  6000  64  8  128 4  96  0
p p4          1e-3  4000  64  4  128 4  96  0
p curric      1e-3  6000  64  8  128 4  96  1
p s32p4       1e-3  6000  32  4  128 4  96  0
p maxpool     1e-3  6000  64  8  128 4  96  0
p b384        2e-3  3000  64  8  128 4  384 0
p s96p8       1e-3  5000  96  8  128 4  96  0
wait
for f in /tmp/*.log; do grep acc $f | awk 'NR%2==0' | tr '\n' ' '; echo; done | tee $OUT/probe.txt
