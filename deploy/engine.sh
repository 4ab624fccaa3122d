#!/usr/bin/env bash
# The container engine the compose smoke needs, on a Debian machine without it: Debian's docker.io and
# docker-compose (and debootstrap, for deploy/local-base.sh) when missing, and dockerd started in the background
# when none answers (machines without systemd; its log: /var/log/asyncgrpo-dockerd.log). Needs root for both.
set -euo pipefail

missing=()
[[ -x /usr/sbin/dockerd ]] || missing+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    echo "engine.sh: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
    echo "engine.sh: starting dockerd"
    nohup /usr/sbin/dockerd >>/var/log/asyncgrpo-dockerd.log 2>&1 &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { echo "engine.sh: dockerd did not answer in 60 s: /var/log/asyncgrpo-dockerd.log" >&2; exit 1; }
fi
echo "engine.sh: $(docker version --format 'docker {{.Server.Version}}')"
