#!/usr/bin/env bash
# Download into bench/wheels/ the project's small pure-Python dependencies that a bare GPU machine
# (CUDA torch, transformers, numba, no package index) lacks, for bench/gpu_smoke.sh to unpack
# there: tyro and math-verify with their own pure-Python dependencies, under 1 MB together.
# Run it where PyPI is reachable, then bring the repository (bench/wheels/ included) along.
# The versions are those requirements.txt pins, or resolves to for the dependencies.
#
#   PYTHON=.venv/bin/python bench/fetch_wheels.sh
set -euo pipefail
WHEELS="$(dirname "$0")/wheels"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
ls -l "$WHEELS"
