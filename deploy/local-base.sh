#!/usr/bin/env bash
# Builds the base images the Dockerfiles and docker-compose.yml start from, out of Debian's archive alone, for a
# machine that reaches no image registry (where `FROM python:…` and `redis:7.2` cannot be pulled):
#   asyncgrpo-local/debian:bookworm   debootstrap --variant=minbase bookworm, imported
#   asyncgrpo-local/python:3.11       Debian's Python 3.11 with a venv at /opt/venv first on PATH
#                                     (python, python3, pip, torchrun run from it, as in the python: images)
#   asyncgrpo-local/redis:7.0         Debian's redis-server 7.0 (ACL selectors as the compose file uses them),
#                                     as user redis, data in /data
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

force=0
[[ ${1:-} == --force ]] && force=1

have() { [[ $force == 0 ]] && "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

if ! have "$DEBIAN_IMAGE"; then
    command -v debootstrap >/dev/null || { echo "local-base.sh: no debootstrap: apt-get install debootstrap" >&2; exit 1; }
    rootfs=$(mktemp -d /var/tmp/asyncgrpo-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    echo "local-base.sh: debootstrap bookworm from $MIRROR"
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | "$DOCKER" import - "$DEBIAN_IMAGE" >/dev/null
    echo "local-base.sh: $DEBIAN_IMAGE imported"
fi
for pair in "python:$PYTHON_IMAGE" "redis:$REDIS_IMAGE"; do
    name=${pair%%:*} image=${pair#*:}
    if ! have "$image"; then
        "$DOCKER" build -q --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$image" \
            -f "$HERE/base/$name.Dockerfile" "$HERE/base" >/dev/null
        echo "local-base.sh: $image built"
    fi
done
