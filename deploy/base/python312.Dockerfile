# asyncgrpo-local/python:3.12 (deploy/local-base.sh --python312 PREFIX): the GPU image's Python (3.12, which
# Debian bookworm does not package) from a CPython 3.12 already built on this machine (PREFIX: its installation,
# e.g. pyenv's), on Debian bookworm with the compiler and libraries the full python: image has for Triton's and
# FlashInfer's kernels; a venv at /opt/venv first on PATH. For building and checking the GPU image where no
# registry is reachable; the GPU box builds on the pinned python:3.12 image.
ARG DEBIAN_IMAGE=asyncgrpo-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev libssl3 libffi8 libsqlite3-0 \
        zlib1g libbz2-1.0 liblzma5 libreadline8 libncursesw6 libgdbm6 libuuid1 libexpat1 \
    && rm -rf /var/lib/apt/lists/*
COPY python /opt/python
ENV LD_LIBRARY_PATH=/opt/python/lib
RUN /opt/python/bin/python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH LANG=C.UTF-8
CMD ["python3"]
