#!/usr/bin/env bash
# `make image-gpu`: builds deploy/gpu.Dockerfile (requirements/gpu.txt: vLLM's and torch's CUDA builds) on a
# machine without a GPU, then runs deploy/image_check.py --expect cuda inside it and prints its size and build
# time. Usage: build-gpu-image.sh TAG local|public [PYTHON312_PREFIX]
#   local: the base is asyncgrpo-local/python:3.12 (deploy/local-base.sh --python312 PREFIX), for machines that
#          reach no registry; public: the Dockerfile's pinned python:3.12 image.
# pip's settings and CA bundle come in as build secrets (deploy/pip_build_config.py), never in a layer.
set -euo pipefail
tag=${1:?usage: build-gpu-image.sh TAG local|public [PYTHON312_PREFIX]} base=${2:-local} prefix=${3:-}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
docker=docker
docker buildx version >/dev/null 2>&1 || docker=/usr/bin/docker  # Debian's 20.10 client builds with BuildKit
work=$(mktemp -d /var/tmp/asyncgrpo-gpu-image.XXXXXX)
server=
cleanup() { [[ -n $server ]] && kill "$server" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

args=()
if [[ $base == local ]]; then
    [[ -n $prefix ]] || { echo "build-gpu-image.sh: no CPython 3.12 here: set PYTHON312_PREFIX" >&2; exit 1; }
    DOCKER=$docker deploy/local-base.sh --python312 "$prefix"
    args+=(--build-arg BASE_IMAGE=asyncgrpo-local/python:3.12)
fi
python3 deploy/pip_build_config.py write "$work/pip" --port 8766
if [[ -n $(ls "$work/pip/serve") ]]; then
    python3 deploy/pip_build_config.py serve "$work/pip" --port 8766 &
    server=$!
fi
start=$(date +%s)
DOCKER_BUILDKIT=1 $docker build --network=host --secret "id=pipconf,src=$work/pip/pip.conf" \
    --secret "id=cacert,src=$work/pip/cacert" "${args[@]}" -f deploy/gpu.Dockerfile -t "$tag" .
built=$(($(date +%s) - start))
docker run --rm -i --entrypoint python "$tag" - --expect cuda <deploy/image_check.py
size=$(docker image inspect --format '{{.Size}}' "$tag")
echo "image-gpu: $tag built in ${built} s, $((size / 1000000)) MB; the import check passed"
