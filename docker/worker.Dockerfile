# The Prefect worker image: the project, its pipeline environment, and a worker on the process pool.
# Build from the project root:  docker build -f docker/worker.Dockerfile -t eagle3-worker .
# TORCH_INDEX picks the torch build: the CUDA 12.8 wheels by default (a GPU node trains and extracts);
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu for a CPU-only worker.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# The Prefect client's retry window, as the eagle3 command sets it (cli/prefect_client.py says why): the worker,
# the flow runs it starts and the Ray nodes of this image ride out a Prefect server or database restart of up to
# ~100 s (docs/faults.md#orchestrator-loss).
ENV PYTHONUNBUFFERED=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1 \
    HF_HUB_OFFLINE=0 \
    EAGLE3_PROJECT_DIR=/opt/eagle3 \
    PREFECT_CLIENT_MAX_RETRIES=6 \
    PREFECT_CLIENT_RETRY_JITTER_FACTOR=0.2 \
    PREFECT_CLIENT_RETRY_EXTRA_CODES=500 \
    PREFECT_API_REQUEST_TIMEOUT=60

RUN apt-get update && apt-get install -y --no-install-recommends curl git && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/eagle3

COPY requirements/pipeline.txt requirements/pipeline.txt
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
 && pip install --no-cache-dir -r requirements/pipeline.txt

COPY pyproject.toml Makefile README.md ./
COPY eagle3 eagle3
COPY flows flows
COPY tasks tasks
COPY deployments deployments
COPY scripts scripts
RUN pip install --no-cache-dir --no-deps -e .

# PREFECT_API_URL comes from the environment (compose sets it to the server's /api).
CMD ["prefect", "worker", "start", "--pool", "eagle3-process"]
