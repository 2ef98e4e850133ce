# One image for every rlpipe service; pick the service with the command:
#   docker build -t rlpipe:local .
#   docker run --rm rlpipe:local run reward
# GPU build (torch from the CUDA index; the host needs only the NVIDIA driver):
#   docker build -t rlpipe-gpu:local \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# compose.yaml defines health checks, so the image has no HEALTHCHECK.
# Written for the classic builder too (no BuildKit-only syntax), since
# docker-compose v1 may build without BuildKit.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build

# CPU wheels by default: the CUDA ones are several GB and useless without a GPU.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional extras of the project, e.g. "vllm" for the GPU image.
ARG RLPIPE_EXTRAS=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# A venv is copied whole into the runtime stage, leaving pip's build
# leftovers behind.
RUN python -m venv /opt/venv

WORKDIR /src

# Dependencies first, from pyproject.toml alone, so a source change does not
# reinstall torch. torch comes from TORCH_INDEX_URL at the version that
# pyproject pins (a CUDA wheel such as 2.13.0+cu128 still satisfies ==2.13.0);
# everything else from PyPI.
COPY pyproject.toml ./
RUN python -c "import re, tomllib; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
is_torch = lambda d: re.split(r'[^A-Za-z0-9_.-]', d, maxsplit=1)[0] == 'torch'; \
open('/tmp/torch.txt', 'w').write('\\n'.join(filter(is_torch, deps))); \
open('/tmp/deps.txt', 'w').write('\\n'.join(d for d in deps if not is_torch(d)))" \
 && pip install --index-url "$TORCH_INDEX_URL" -r /tmp/torch.txt \
 && pip install -r /tmp/deps.txt

COPY . .
RUN if [ -n "$RLPIPE_EXTRAS" ]; then pip install ".[$RLPIPE_EXTRAS]"; else pip install .; fi \
 && rlpipe --help >/dev/null


FROM ${PYTHON_IMAGE}

# bubblewrap: the env-gateway's per-episode sandbox.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*

# Non-root: a sandbox escape or a bad tool call lands as an unprivileged user.
# /data/* exist in the image owned by that user so that named volumes mounted
# there start out writable by it.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin rlpipe \
 && mkdir -p /data/runs /data/hf /data/weights-signing /data/weights-public \
 && chown -R rlpipe:rlpipe /data

COPY --from=build /opt/venv /opt/venv

# Unbuffered: logs reach `docker compose logs` as they happen.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER rlpipe
WORKDIR /home/rlpipe

ENTRYPOINT ["rlpipe"]
CMD ["--help"]
