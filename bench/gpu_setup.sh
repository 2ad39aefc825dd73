# Sourced by every bench/*.sh run on the GPU machine (the `device` tool, carrying .whl/): installs
# the wheels its image lacks (redis, rq, pydantic, ...; ../shared/GPU.md) and the project itself.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "project install failed"; exit 1; }
