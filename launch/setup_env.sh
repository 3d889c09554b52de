#!/usr/bin/env bash
# Create a virtual environment with torch 2.13.0 installed FIRST (an unpinned torch would resolve to a multi-GB CUDA
# build), then the package. Usage: bash launch/setup_env.sh [VENV_DIR=.venv]
set -euo pipefail
venv="${1:-.venv}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0"
# The package is a flat layout (hosfl_dist/ at the root), so setuptools installs it through a meta path finder and
# says so in an informational "Editable installation." notice, which pip (26.3 here) re-emits as a warning on every
# editable install. Only that notice is filtered, by its message; errors and any other warning still print.
PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation" \
  "$venv/bin/python" -m pip install -q -e "$(cd "$(dirname "$0")/.." && pwd)"
echo "environment ready: $venv (activate with: . $venv/bin/activate)"
