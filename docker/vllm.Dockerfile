# The target server image: vLLM's own GPU image (the same vLLM release the CPU tests run, 0.32.0) plus the project's hidden-state extraction worker
# (the `extract.backend = "vllm"` route runs eagle3/extract/vllm_worker.py with this Python).
# Build from the project root:  docker build -f docker/vllm.Dockerfile -t eagle3-vllm .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

COPY eagle3/extract/vllm_worker.py eagle3/extract/vllm_connector.py /opt/eagle3/extract/
ENV EAGLE3_VLLM_WORKER=/opt/eagle3/extract/vllm_worker.py
COPY --chmod=755 scripts/secret-env.sh /opt/eagle3/secret-env.sh

# Serve the target (compose passes the model and flags); the pipeline's external mode points
# server.urls at http://vllm:8000/v1. The key the server requires comes from the file VLLM_API_KEY_FILE
# names (a compose secret): secret-env.sh sets VLLM_API_KEY from it, which vLLM reads (vllm/envs.py), so
# the key is never on the server's command line.
ENTRYPOINT ["/opt/eagle3/secret-env.sh", "python3", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
