# fp4train on a CUDA machine (Hopper: emulated NVFP4 + native FP8; Blackwell: add the `te` extra).
# Build: docker build -t fp4train .
# Run:   docker run --gpus all -v $PWD/runs:/app/runs fp4train pretrain --recipe hybrid-125m
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
COPY recipes ./recipes
COPY scripts ./scripts
# torch and triton come with the base image; install the rest and the package itself (editable, so
# the built-in recipes/ folder is found next to the sources).
RUN pip install --no-cache-dir -e ".[gpu]"

ENTRYPOINT ["fp4train"]
CMD ["--help"]
