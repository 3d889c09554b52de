#!/usr/bin/env bash
# Create a virtual environment with torch 2.13.0 installed FIRST (an unpinned torch would resolve to a multi-GB CUDA
# build), then the package. Usage: bash launch/setup_env.sh [VENV_DIR=.venv]
set -euo pipefail
venv="${1:-.venv}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0"
"$venv/bin/python" -m pip install -q -e "$(cd "$(dirname "$0")/.." && pwd)"
echo "environment ready: $venv (activate with: . $venv/bin/activate)"
