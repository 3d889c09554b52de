#!/usr/bin/env bash
# One command from a fresh checkout to a trained model: creates .venv (torch 2.13.0 first) if missing, installs the
# Fashion-MNIST Debian package if missing (root), then trains configs/quickstart.yaml under torchrun on CPU (NPROC=3:
# the server and 2 client workers, see launch/torchrun.sh). Extra arguments are passed on as overrides, e.g.
# `bash launch/quickstart.sh zo.num_perturbations=8`; NPROC=1 runs the in-process engine instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || bash launch/setup_env.sh "$VENV"
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  if [ "$(id -u)" = 0 ]; then
    # apt and debconf write notices to stderr that read like trouble ("debconf: delaying package configuration, since
    # apt-utils is not installed"): their output goes to a log, shown only if the install fails.
    export DEBIAN_FRONTEND=noninteractive
    apt_log=$(mktemp /tmp/hosfl-apt.XXXXXX)
    if apt-get update -qq >"$apt_log" 2>&1 && apt-get install -y -qq dataset-fashion-mnist >>"$apt_log" 2>&1; then
      echo "installed dataset-fashion-mnist"
      rm -f "$apt_log"
    else
      echo "installing dataset-fashion-mnist failed; the end of apt's output (all of it in $apt_log):" >&2
      tail -n 20 "$apt_log" >&2
      exit 1
    fi
  else
    echo "Fashion-MNIST missing: run 'sudo apt-get install dataset-fashion-mnist' (or set data.root=...)" >&2
    exit 2
  fi
fi
if [ "${NPROC:-3}" = 1 ]; then
  exec "$VENV/bin/python" -m hosfl_dist.run --config configs/quickstart.yaml "$@"
fi
VENV="$VENV" CONFIG=configs/quickstart.yaml exec bash launch/torchrun.sh "$@"
