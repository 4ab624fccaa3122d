# asyncgrpo-local/redis:7.0 (deploy/local-base.sh): Debian bookworm's redis-server 7.0, standing in for the
# redis:7.2 image docker-compose.yml names by default where no registry is reachable. It runs as user redis
# with its data in /data, as the official image does after its entry point drops root.
ARG DEBIAN_IMAGE=asyncgrpo-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
# The redis user and group made first with uid and gid 999, the official image's, so that docker-compose.yml's
# `user: "999:999"` owns /data here too (the package keeps an existing redis user).
# hadolint ignore=DL3008
RUN groupadd --system --gid 999 redis && useradd --system --uid 999 --gid redis --home-dir /var/lib/redis redis \
    && apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
# uid 999, as docker-compose.yml's redis service runs
# hadolint ignore=DL3066
USER redis
EXPOSE 6379
CMD ["redis-server"]
