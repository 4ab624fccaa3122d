# asyncgrpo-local/python:3.11 (deploy/local-base.sh): Debian bookworm's Python 3.11 with a venv at /opt/venv
# first on PATH, so `python`, `pip` and the scripts packages install (torchrun) are found as in the official
# python: images the Dockerfiles name by default, with Python's headers as they have them (torch's inductor
# compiles against them). For machines that reach Debian's archive but no registry.
ARG DEBIAN_IMAGE=asyncgrpo-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ca-certificates libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH LANG=C.UTF-8
CMD ["python3"]
