#!/usr/bin/env bash
# `trainrec bench ec` next to FBGEMM's CPU TBE (PoolingMode.NONE) and TorchRec's DMP-sharded
# EmbeddingCollection (scripts/anchors/w1_ec_train.py) on the same flags, interleaved ROUNDS
# times so the machine's noise hits all three; one JSON line per run, then the medians' ratios.
# Usage: scripts/anchors/ec_side_by_side.sh [ROUNDS=2] -- <bench flags, e.g. --tables 4 --rows 100000 --threads 1>
set -euo pipefail
ROUNDS=${1:-2}
shift || true
[ "${1:-}" = "--" ] && shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${ANCHOR_PY:-$HOME/.cache/trainrec-anchors/venv/bin/python}
BIN="$ROOT/target/release/trainrec"
[ -x "$BIN" ] || cargo build --release -p trainrec --bin trainrec >&2
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
for _ in $(seq "$ROUNDS"); do
  "$BIN" bench ec "$@" 2>/dev/null | tee -a "$OUT"
  for impl in tbe dmp; do
    "$PY" "$ROOT/scripts/anchors/w1_ec_train.py" --impl "$impl" "$@" 2>/dev/null | tee -a "$OUT"
  done
done
python3 - "$OUT" <<'PY'
import json, statistics as st, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = {}
for r in runs:
    med.setdefault(r["impl"], []).append(r["step"]["median_s"])
m = {k: st.median(v) for k, v in med.items()}
print(json.dumps({"summary": True, "step_median_s": m,
                  "trainrec_speedup_vs": {k: m[k] / m["trainrec"] for k in m if k != "trainrec"}}))
PY
