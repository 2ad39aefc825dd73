# wicore's container image, in two variants of one file:
#   docker build -t wicore:cpu .                          # CPU torch: the gateway, CPU workers, the CLI
#   docker build -t wicore:cuda --build-arg VARIANT=cuda .  # CUDA torch: GPU workers
# torch's CUDA wheels carry the CUDA runtime; the host needs only the NVIDIA driver and the
# container toolkit (compose: the device reservation; Kubernetes: nvidia.com/gpu). The images
# deploy/compose.yaml and deploy/k8s run are these two tags.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ARG VARIANT=cpu
ARG TORCH=2.13.0
ARG CUDA_WHEELS=cu128
# Every feature a setting or a request turns on: grammars, s3:// and http(s):// images, HEIC, S3 batch files.
ARG EXTRAS=worker,serve,dashboard,guided,urls,heif,s3

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN case "$VARIANT" in \
      cpu) wheels=cpu ;; \
      cuda) wheels="$CUDA_WHEELS" ;; \
      *) echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 1 ;; \
    esac \
 && pip install --index-url "https://download.pytorch.org/whl/$wheels" "torch==$TORCH"

COPY . /src
RUN pip install "/src[$EXTRAS]" && rm -rf /src

# Workers write their caches here (mount a volume to keep them across restarts).
ENV XDG_CACHE_HOME=/root/.cache
EXPOSE 8000 9100
CMD ["wicore", "--help"]
