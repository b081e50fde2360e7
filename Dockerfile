# fp4train on a CUDA machine (Hopper: emulated NVFP4 + native FP8; Blackwell: native NVFP4 through
# Transformer Engine, which the base image ships).
# Build: docker build -t fp4train .
# Run:   docker run --gpus all -v "$PWD/runs:/app/runs" fp4train pretrain --recipe hybrid-125m
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY recipes ./recipes
# torch, triton and Transformer Engine come with the base image; install the package itself, not
# editable (the built-in recipes travel as package data), then check what it finds here.
RUN pip install --no-cache-dir "./[gpu]" && rm -rf /src/build && fp4train info

WORKDIR /app
ENTRYPOINT ["fp4train"]
CMD ["--help"]
