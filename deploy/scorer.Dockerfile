# Scorer (and the example reward plugin): slim Python with the CPU build of torch, no vLLM.
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.8.0"
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
EXPOSE 8002 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8002/health')"]
ENTRYPOINT ["python", "-m", "services.scorer"]
