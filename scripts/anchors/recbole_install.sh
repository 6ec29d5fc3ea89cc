#!/usr/bin/env bash
# Install RecBole 1.2.1 (the independent SASRec reference run by recbole_sasrec.py) without
# downloading torch again.
#
# Usage: bash scripts/anchors/recbole_install.sh [RECBOLE_VENV] [ANCHORS_VENV]
#   RECBOLE_VENV  default ~/.cache/trainrec-anchors/recbole-venv  (created here)
#   ANCHORS_VENV  default ~/.cache/trainrec-anchors/venv  (the TorchRec venv made by
#                 ../shared/bench/anchors/install.sh; it provides torch 2.14.1 + numpy 2)
#
# How: a separate venv on the same interpreter, whose site-packages holds a .pth line naming the
# anchors venv's site-packages, so torch/numpy/tqdm come from there (appended to sys.path after
# this venv's own packages) and pip treats them as installed. RecBole goes in with --no-deps and
# its requirements are listed by hand, leaving out:
#   - ray (<=2.6.3): only recbole/quick_start imports it, and that old ray breaks on numpy 2;
#     recbole_sasrec.py never imports recbole.quick_start.
#   - plotly / hyperopt: only recbole/trainer/hyper_tuning.py uses them.
# Pins: pandas<3 (recbole/data/dataset/dataset.py:648,650 fill NaNs with chained inplace
# fillna, which pandas 3's copy-on-write turns into a silent no-op), setuptools<81 (keeps
# pkg_resources for older RecBole deps such as ray / old tensorboard; nothing on the path
# recbole_sasrec.py imports needs it today), colorlog/colorama pinned as RecBole pins them.
# Idempotent: rerunning only checks that everything is there and prints the versions.
set -euo pipefail
VENV=${1:-$HOME/.cache/trainrec-anchors/recbole-venv}
ANCHORS=${2:-$HOME/.cache/trainrec-anchors/venv}

if [ ! -x "$ANCHORS/bin/python" ]; then
    echo "anchors venv $ANCHORS missing: run ../shared/bench/anchors/install.sh first" >&2
    exit 1
fi
ANCHORS_SITE=$("$ANCHORS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

if [ ! -x "$VENV/bin/python" ]; then
    # `python -m venv` run from a venv builds on that venv's base interpreter (same version).
    "$ANCHORS/bin/python" -m venv "$VENV"
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ANCHORS_SITE" > "$SITE/zz_trainrec_anchors.pth"

PY="$VENV/bin/python"
CONS=$(mktemp)
trap 'rm -f "$CONS"' EXIT
# Never let pip replace the anchors venv's torch / numpy.
"$ANCHORS/bin/python" -m pip freeze 2>/dev/null | grep -Ei '^(torch|numpy)==' > "$CONS"

"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -c "$CONS" --no-deps recbole==1.2.1
"$PY" -m pip install -q -c "$CONS" \
    'setuptools<81' 'pandas>=2.2,<3' 'scipy>=1.6' 'scikit-learn>=0.23.2' 'pyyaml>=5.1' \
    colorlog==4.7.2 colorama==0.4.4 'tensorboard>=2.5' 'thop>=0.1.1.post2207130030' \
    'texttable>=0.9' 'psutil>=5.9' 'tabulate>=0.8.10'
echo "(a pip note that recbole requires ray / plotly is expected: both are left out on purpose)"

"$PY" - <<'EOF'
import importlib.metadata as md, os, sys
import numpy, torch
# recbole_sasrec.py applies the same numpy-2 aliases before building a Config.
for old, new in (("float_", "float64"), ("complex_", "complex128"), ("unicode_", "str_")):
    if not hasattr(numpy, old):
        setattr(numpy, old, getattr(numpy, new))
import recbole
from recbole.config import Config
from recbole.data import create_dataset, data_preparation
from recbole.model.sequential_recommender import SASRec
from recbole.trainer import Trainer
ex = os.path.join(os.path.dirname(recbole.__file__), "dataset_example", "ml-100k", "ml-100k.inter")
print("python", sys.version.split()[0], "| torch", torch.__version__, "(", torch.__file__, ")")
for name in ("recbole", "numpy", "pandas", "scipy", "scikit-learn", "setuptools", "tensorboard",
             "colorlog", "thop"):
    print(name, md.version(name))
print("ml-100k.inter", ex, "exists" if os.path.exists(ex) else "MISSING")
EOF
