#!/usr/bin/env bash
# Run on a machine with pip access, before a GPU machine is lent: download the wheels the GPU
# image lacks, for its Python 3.12 on x86-64, into benchmarks/gpu/wheels/ (ignored by git).
# run.sh installs them there with --no-deps, so the image's CUDA torch is never replaced.
#
#   bash benchmarks/gpu/fetch_wheels.sh [DEST]
#
# The image already has torch (CUDA), numpy, pandas, pyarrow, psutil, packaging, pyyaml,
# cloudpickle, typing-extensions, matplotlib; train.worker additionally imports Megatron-Core and
# safetensors (the node-local tier's shards),
# and the run-directory composition imports Hydra/OmegaConf (and antlr4, their parser runtime)
# and submitit (the renderer). Versions: the ones the CPU test suite runs with.
set -euo pipefail
cd "$(dirname "$0")"
DEST=${1:-wheels}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_28_x86_64 --platform any)
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" \
    megatron-core==0.16.1 safetensors==0.8.0 hydra-core==1.3.8 omegaconf==2.3.1 submitit==1.5.4
# antlr4-python3-runtime 4.9.3 (the version hydra-core/omegaconf pin) is published as an sdist
# only: build its pure-Python wheel here (py3-none-any, valid on any Python 3).
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" antlr4-python3-runtime==4.9.3 2>/dev/null \
    || "$PY" -m pip wheel -q --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
if ls "$DEST" | grep -qiE '^(torch|nvidia_|triton)[-_]'; then
    echo "fetch_wheels: a torch/CUDA wheel landed in $DEST; remove it (the image's torch must stay)" >&2
    exit 1
fi
ls -l "$DEST"
du -sh "$DEST"
