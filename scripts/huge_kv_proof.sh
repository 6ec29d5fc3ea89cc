#!/usr/bin/env bash
# "Larger than memory" end to end: a key-value table of ROWS x 64 (10^8 by default: 25.6 GB of
# fp32 weights) trains, checkpoints, resumes, evaluates and exports, each step's peak resident
# memory measured by `/usr/bin/time -v`. Checkpoints hold only the rows written; the export
# streams the whole table to disk a chunk at a time (it needs ROWS x 256 bytes free under OUT).
# Prints one JSON line per step.
#   scripts/huge_kv_proof.sh [ROWS] [OUT] [STEPS]     (export skipped when SKIP_EXPORT=1)
set -euo pipefail
rows="${1:-100000000}"
out="${2:-/tmp/trainrec-huge-kv}"
steps="${3:-3000}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/target/release/trainrec"
[ -x "$bin" ] || cargo build --release -p trainrec --manifest-path "$root/Cargo.toml" >&2
rm -rf "$out"
mkdir -p "$out"
cat > "$out/recipe.toml" <<TOML
[run]
name = "huge_kv"
seed = 7
output_dir = "$out/run"

[data]
batch_size = 1024
eval_batch_size = 8192

[data.sampler]
kind = "synthetic"
dense_features = 13
sparse_features = ["C1", "C2"]
ids = "zipf"
zipf_alpha = 1.05
train_samples = 100_000_000
eval_samples = 100_000

[[tables]]
name = "big"
features = ["C1"]
rows = $rows
dim = 64
constraints = { compute_kernels = ["key_value"], cache = { load_factor = 0.001, algorithm = "lru" } }

[[tables]]
name = "small"
features = ["C2"]
rows = 1000
dim = 64

[model]
kind = "dlrm"
dense_arch = [64, 64]
over_arch = [64, 1]

[optimizer]
sparse = { kind = "rowwise_adagrad", lr = 0.05 }
dense = { kind = "adam", lr = 0.002 }

[train]
steps = $steps
eval_every = $steps
log_every = 1000
checkpoint_every = $steps
progress = false

[[metrics]]
kind = "auc"
TOML
# step NAME COMMAND...: runs it under /usr/bin/time -v and prints its peak RSS and wall time.
step() {
  local name="$1"
  shift
  /usr/bin/time -v -o "$out/$name.time" "$@" > "$out/$name.log" 2>&1 || {
    echo "{\"step\": \"$name\", \"failed\": true}"
    tail -5 "$out/$name.log" >&2
    exit 1
  }
  local rss wall
  rss=$(awk -F: '/Maximum resident/ {gsub(/ /, "", $2); print $2}' "$out/$name.time")
  wall=$(awk '/Elapsed/ {print $NF}' "$out/$name.time")
  echo "{\"step\": \"$name\", \"rows\": $rows, \"peak_rss_mib\": $((rss / 1024)), \"wall\": \"$wall\"}"
}
ck_bytes() { du -sb "$out/run/checkpoints/$(ls "$out/run/checkpoints" | tail -1)" | cut -f1; }
step train "$bin" run "$out/recipe.toml" --log-level warn
echo "{\"checkpoint_bytes\": $(ck_bytes), \"stored_rows\": $(python3 -c "
import json,glob
m=json.load(open(sorted(glob.glob('$out/run/checkpoints/*/manifest.json'))[-1]))
print(sum(m['tensors'][s['stored_rows']]['shape'][0] for s in m['shards'] if s.get('stored_rows')))")}"
step resume "$bin" run --resume "$out/run" --set "train.steps=$((steps * 2))" --set "train.eval_every=$((steps * 2))" --set "train.checkpoint_every=$((steps * 2))" --log-level warn
echo "{\"checkpoint_bytes\": $(ck_bytes)}"
step eval "$bin" eval "$out/run" --json --log-level warn
grep '^{' "$out/eval.log" | tail -1
if [ "${SKIP_EXPORT:-0}" != 1 ]; then
  step export "$bin" export "$out/run" --out "$out/model.safetensors" --log-level warn
  echo "{\"export_bytes\": $(stat -c %s "$out/model.safetensors")}"
  rm -f "$out/model.safetensors"
fi
