# syntax=docker/dockerfile:1.7
# pdgate container images (BuildKit; the heredocs need dockerfile syntax >= 1.4).
#
#   docker build --target router -t pdgate-router .   # slim: no torch, no nixl, no CUDA
#   docker build --target shim   -t pdgate-shim   .   # CUDA runtime + torch + nixl-cu13
#
# Both run as the unprivileged user 10001 and start through the `pdgate` console script,
# so `docker run IMAGE --help` prints the subcommand's options. Every Python package is
# pinned (the constraints files below: the versions CI tests with); bump them together
# with pyproject.toml. tests/deploy/test_dockerfile.py checks this file against the tree.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

# ---------------------------------------------------------------- router: build the venv
FROM ${PYTHON_IMAGE} AS router-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY <<EOF /src/constraints-router.txt
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
click==8.5.1
fastapi==0.165.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
googleapis-common-protos==1.76.0
grpcio==1.85.3
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpcore2==2.16.2
httptools==0.9.0
httpx==0.28.1
httpx2==2.16.2
huggingface-hub==2.4.0
idna==3.20
jinja2==3.1.6
markdown-it-py==4.3.0
markupsafe==3.0.4
mdurl==0.1.2
msgspec==0.22.0
multidict==7.2.1
numpy==2.4.6
opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2
opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2
opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2
packaging==26.4
prometheus-client==0.26.0
propcache==0.5.4
protobuf==7.36.2
pydantic==2.14.4
pydantic-core==2.50.5
pygments==2.21.0
python-dotenv==1.2.4
pyyaml==6.0.4
pyzmq==27.3.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
shellingham==1.5.4
sniffio==1.3.1
starlette==1.10.0
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.24.0
truststore==0.10.5
typer==0.29.2
typing-extensions==4.16.0
typing-inspection==0.4.5
urllib3==2.8.0
uvicorn==0.54.0
uvloop==0.23.0
watchfiles==1.3.0
websockets==17.4
yarl==1.25.1
EOF
COPY pyproject.toml README.md ./
COPY src/pdgate/__init__.py src/pdgate/py.typed src/pdgate/cli.py ./src/pdgate/
COPY src/pdgate/router ./src/pdgate/router
COPY src/pdgate/proxy ./src/pdgate/proxy
COPY src/pdgate/contract ./src/pdgate/contract
COPY src/pdgate/common ./src/pdgate/common
# Only the router's packages are copied, so the wheel has no engine_shim and the image
# cannot import torch or nixl even by accident (tests/deploy/test_wheel.py builds this list).
# The otel extra (both OTLP exporters) is in both images: tracing is switched on by
# configuration alone (common/tracing.py). The hf extra (transformers) too: the router's
# token-reading features (prefix-aware routing, notify/push modes) need it.
RUN python -m venv /opt/pdgate \
 && /opt/pdgate/bin/pip install --constraint constraints-router.txt '.[otel,hf]' \
 && /opt/pdgate/bin/python -c "import pdgate.router.http.app, pdgate.proxy; import importlib.util as u; \
import opentelemetry.exporter.otlp.proto.grpc.trace_exporter, opentelemetry.exporter.otlp.proto.http.trace_exporter; \
assert u.find_spec('torch') is None and u.find_spec('nixl') is None"

# ---------------------------------------------------------------- router: runtime image
FROM ${PYTHON_IMAGE} AS router
# The commit built (pdgate_build_info's commit label): --build-arg PDGATE_COMMIT=$(git rev-parse --short HEAD)
ARG PDGATE_COMMIT=unknown
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin pdgate
COPY --from=router-build /opt/pdgate /opt/pdgate
ENV PATH=/opt/pdgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDGATE_COMMIT=${PDGATE_COMMIT} \
    HF_HOME=/tmp/hf \
    PDGATE_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['PDGATE_HEALTH_URL'], timeout=2)"]
ENTRYPOINT ["pdgate", "router"]
CMD ["--config", "/etc/pdgate/router.yaml", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------- shim: CUDA engine image
FROM ${CUDA_IMAGE} AS shim
ARG TORCH_INDEX_URL
ARG PDGATE_COMMIT=unknown
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pdgate
WORKDIR /src
COPY <<EOF /src/constraints-shim.txt
torch==2.13.0
nixl-cu13==1.5.1
safetensors==0.8.0
numpy==2.4.6
EOF
COPY --from=router-build /src/constraints-router.txt /src/constraints-router.txt
COPY pyproject.toml README.md ./
# The shim's packages only: an engine image carries no router code.
COPY src/pdgate/__init__.py src/pdgate/py.typed src/pdgate/cli.py ./src/pdgate/
COPY src/pdgate/engine_shim ./src/pdgate/engine_shim
COPY src/pdgate/proxy ./src/pdgate/proxy
COPY src/pdgate/contract ./src/pdgate/contract
COPY src/pdgate/common ./src/pdgate/common
# torch from the CUDA 13 index first (the shim extra's range accepts it: no re-resolve),
# then the project with its shim extra (nixl-cu13, not the `nixl` meta package that would
# pull the CUDA 12 build too).
RUN python3 -m venv /opt/pdgate \
 && /opt/pdgate/bin/pip install --index-url ${TORCH_INDEX_URL} torch==2.13.0 \
 && /opt/pdgate/bin/pip install --constraint constraints-shim.txt \
        --constraint constraints-router.txt '.[shim,otel]' \
 && rm -rf /src
ENV PATH=/opt/pdgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDGATE_COMMIT=${PDGATE_COMMIT} \
    HF_HOME=/home/pdgate/.cache/huggingface \
    PDGATE_HEALTH_URL=http://127.0.0.1:8100/health
WORKDIR /home/pdgate
USER 10001:10001
# 8100: OpenAI HTTP API; 5600: NIXL metadata side channel (vLLM's default port). The side
# channel host is both bound and sent to decode engines, so it must be the pod/host IP:
# pass `--side-channel-host $(POD_IP)` (the Helm chart does).
EXPOSE 8100 5600
HEALTHCHECK --interval=15s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['PDGATE_HEALTH_URL'], timeout=2)"]
ENTRYPOINT ["pdgate", "shim"]
CMD ["--host", "0.0.0.0", "--port", "8100", "--device", "cuda", "--side-channel-port", "5600"]
