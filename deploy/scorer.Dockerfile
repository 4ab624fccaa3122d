# The scorer image (asyncgrpo-scorer:0.1.0), also run as the example reward plugin (`services.reward_plugin`).
# Light: requirements/scorer.txt is the `scorer` dependency group of pyproject.toml (the CPU torch for the
# advantage arithmetic, math-verify, FastAPI, Redis), at the versions of the CPU lock the tests run; no vLLM,
# no transformers.
#
# Base: Python 3.11 as in CI, pinned by exact tag and digest; the digest is the one public material gives for
# python:3.11.14-slim-bookworm (huanghuadixuwu-coder/RepoFixLab, packages/repofixlab/docker/controller.Dockerfile).
# BASE_IMAGE replaces it with any image that has Python 3.11 and pip on PATH (deploy/local-base.sh builds one
# from Debian's archive where no registry is reachable).
ARG BASE_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# The CPU torch comes only from the PyTorch CPU index (override with --build-arg TORCH_INDEX=…; empty: from
# where the pip settings below say); the rest from PyPI; every file is checked against the lock's hash.
# Behind a proxy or a mirror, pip's settings and CA bundle come in as build secrets (pipconf, cacert;
# deploy/pip_build_config.py writes them from the host's), mounted for this command only: never in a layer.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY requirements/torch-cpu.txt requirements/scorer.txt requirements/
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=cacert \
    if [ -s /run/secrets/pipconf ]; then export PIP_CONFIG_FILE=/run/secrets/pipconf; fi \
    && pip install --no-cache-dir --no-deps --require-hashes --only-binary :all: ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} \
        -r requirements/torch-cpu.txt \
    && pip install --no-cache-dir --no-deps --require-hashes --only-binary :all: -r requirements/scorer.txt
# The project runs from /app (`python -m services.…`), so nothing unlocked is installed for it.
COPY shared ./shared
COPY services ./services
# The scorer and the reward plugin run as a user of their own (uid 10001), never root: they need no privilege.
RUN useradd --no-log-init --system --uid 10001 --user-group --create-home --home-dir /home/app app
ENV HOME=/home/app PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8002 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8002/health')"]
ENTRYPOINT ["python", "-m", "services.scorer"]
