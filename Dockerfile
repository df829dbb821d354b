# prefixgate on CPU, for compose.yaml. Build: `docker build -t prefixgate .`
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# The CPU build of torch first (about 200 MB instead of several GB of CUDA wheels);
# the project's own `torch==2.13.0` pin is then already satisfied.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml ./
COPY engine ./engine
COPY gateway ./gateway
COPY metrics ./metrics
COPY configs ./configs
# editable: the code (and its configs/) stay in /app, where the gateway finds configs/default.yaml
RUN pip install -e '.[postgres]'

EXPOSE 8000
# The default model is converted on first start into /root/.cache/prefixgate (a volume in compose.yaml).
CMD ["python", "-m", "gateway", "serve", "--host", "0.0.0.0", "--port", "8000"]
