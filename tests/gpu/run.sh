#!/usr/bin/env bash
# The GPU test suite, for a machine with CUDA that already has torch, lightning and torchmetrics:
# installs nothing, runs from the repository root with the package on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}"
# Cached blocks over 512 MiB are not split for small requests: the out-of-memory tests free a piece's
# block of GiBs and expect the next piece of that size to fit under their memory cap, which a small
# persistent allocation carved out of that cached block would otherwise prevent (seen on an H200).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-max_split_size_mb:512}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
timeout 480 python -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" "$@"
