#!/usr/bin/env bash
# The GPU figures (issue 43) for a machine with CUDA that already has torch, lightning and transformers
# (and sentence-transformers for its cached loss): installs nothing, runs from the repository root with the
# package on PYTHONPATH, writes benchmarks/gpu/RESULTS.md (the device's name in it). About 6 minutes on one
# H100 or H200. Options (harness.py --help):
#   bash benchmarks/gpu/run.sh                              # every part: loop syncs memory passes precision
#   bash benchmarks/gpu/run.sh --skip memory passes         # parts left out
#   bash benchmarks/gpu/run.sh --quick --out /tmp/GPU.md    # the CPU dry run CI executes (tiny sizes)
# PYTHON picks the interpreter (default: python on PATH). Stopped at 8 minutes (the device budget); the results
# file is rewritten after each part, so the parts measured by then are kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="src:benchmarks:benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}"
# (as tests/gpu/run.sh: cached blocks over 512 MiB are not split for small requests, so that the capped
# microbatch_size="auto" part frees and reuses a piece's block)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-max_split_size_mb:512}"
exec timeout 480 "${PYTHON:-python}" benchmarks/gpu/harness.py "$@"
