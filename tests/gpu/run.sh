#!/usr/bin/env bash
# The GPU test suite, for a machine with CUDA that already has torch, lightning and torchmetrics:
# installs nothing, runs from the repository root with the package on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
timeout 480 python -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" "$@"
