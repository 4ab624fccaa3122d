#!/usr/bin/env bash
# Builds the base images the Dockerfiles and docker-compose.yml start from, out of Debian's archive alone, for a
# machine that reaches no image registry (where `FROM python:…` and `redis:7.2` cannot be pulled):
#   asyncgrpo-local/debian:bookworm   debootstrap --variant=minbase bookworm, imported
#   asyncgrpo-local/python:3.11       Debian's Python 3.11 with a venv at /opt/venv first on PATH
#                                     (python, python3, pip, torchrun run from it, as in the python: images)
#   asyncgrpo-local/redis:7.0         Debian's redis-server 7.0 (ACL selectors as the compose file uses them),
#                                     as user redis, data in /data
#   asyncgrpo-local/python:3.12       only with --python312 PREFIX: a CPython 3.12 built on this machine (its
#                                     installation prefix) on bookworm, for the GPU image (`make image-gpu`)
# Then build with BASE_IMAGE=asyncgrpo-local/python:3.11 and REDIS_IMAGE=asyncgrpo-local/redis:7.0 (the
# compose smoke does). Each image is built only when missing; --force builds all three again.
# Needs root (debootstrap), docker and debootstrap (`apt-get install debootstrap`).
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_IMAGE=asyncgrpo-local/debian:bookworm
PYTHON_IMAGE=asyncgrpo-local/python:3.11
REDIS_IMAGE=asyncgrpo-local/redis:7.0
HERE=$(cd "$(dirname "$0")" && pwd)
DOCKER=${DOCKER:-docker}

force=0 python312=
while (($#)); do
    case $1 in
        --force) force=1 ;;
        --python312) python312=${2:?--python312 needs the prefix of a CPython 3.12 installation}; shift ;;
        *) echo "local-base.sh: unknown argument $1 (--force, --python312 PREFIX)" >&2; exit 2 ;;
    esac
    shift
done

have() { [[ $force == 0 ]] && "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

if ! have "$DEBIAN_IMAGE"; then
    command -v debootstrap >/dev/null || { echo "local-base.sh: no debootstrap: apt-get install debootstrap" >&2; exit 1; }
    rootfs=$(mktemp -d /var/tmp/asyncgrpo-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    echo "local-base.sh: debootstrap bookworm from $MIRROR"
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | "$DOCKER" import - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$rootfs"
    echo "local-base.sh: $DEBIAN_IMAGE imported"
fi
# Built every time: Docker's layer cache makes an unchanged one instant, and a changed Dockerfile is never
# answered by a stale image of the same tag.
for pair in "python:$PYTHON_IMAGE" "redis:$REDIS_IMAGE"; do
    name=${pair%%:*} image=${pair#*:}
    "$DOCKER" build -q --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$image" \
        -f "$HERE/base/$name.Dockerfile" "$HERE/base" >/dev/null
    echo "local-base.sh: $image built"
done
if [[ -n $python312 ]] && ! have asyncgrpo-local/python:3.12; then
    [[ -x $python312/bin/python3.12 ]] || { echo "local-base.sh: no $python312/bin/python3.12" >&2; exit 1; }
    context=$(mktemp -d /var/tmp/asyncgrpo-python312.XXXXXX)
    trap 'rm -rf "$context"' EXIT
    # The interpreter, its standard library and headers; not its site-packages, tests or caches.
    tar -C "$python312" -c --exclude=site-packages --exclude=test --exclude=__pycache__ \
        bin/python3.12 lib/libpython3.12.so.1.0 lib/python3.12 include/python3.12 | tar -C "$context" --one-top-level=python -x
    ln -sf libpython3.12.so.1.0 "$context/python/lib/libpython3.12.so"
    cp "$HERE/base/python312.Dockerfile" "$context/"
    "$DOCKER" build -q --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t asyncgrpo-local/python:3.12 \
        -f "$context/python312.Dockerfile" "$context" >/dev/null
    echo "local-base.sh: asyncgrpo-local/python:3.12 built from $python312"
fi
