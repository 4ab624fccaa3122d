# Learner: a PyTorch CUDA image plus this project (vLLM's NCCL helpers for the weight push).
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# The project itself, from this checkout (its dependencies are pinned by pyproject.toml).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gpu]"
ENV PYTHONUNBUFFERED=1
EXPOSE 8003 29500
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8003/health')"]
ENTRYPOINT ["python", "-m", "services.learner"]
