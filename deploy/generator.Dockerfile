# Generator: vLLM's CUDA image plus this project.
FROM vllm/vllm-openai:v0.11.0
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
EXPOSE 8001
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/health')"]
ENTRYPOINT ["python3", "-m", "services.generator"]
