#!/usr/bin/env bash
# Criteo sample, the 15 large features in 64-row tables (equal memory): modulo hashing, managed
# collisions (63 tracked ids + a shared row) and dynamic tables (64 ids, the rest read zeros;
# admission after 1 or 2 sightings), 4 seeds each; one JSON line per run.
#   scripts/dynamic_vs_mc_criteo.sh        (TRAINREC_BIN: default target/release/trainrec)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin="${TRAINREC_BIN:-target/release/trainrec}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
src=recipes/criteo/kaggle_sample_mc.toml
grep -v '^mc = ' "$src" > "$work/modulo.toml"
cp "$src" "$work/mc.toml"
sed 's/^mc = .*/dynamic = { admit_after = 2, eviction = "lfu" }/' "$src" > "$work/dynamic2.toml"
sed 's/^mc = .*/dynamic = { admit_after = 1, eviction = "lfu" }/' "$src" > "$work/dynamic1.toml"
data="$root/../shared/data/criteo-kaggle-sample/train_examples.txt"
for v in modulo mc dynamic1 dynamic2; do
  for seed in 1 2 3 4; do
    out="$work/out-$v-$seed"
    if ! "$bin" run "$work/$v.toml" --set run.seed=$seed --set "data.sampler.path=\"$data\"" \
      --set "run.output_dir=\"$out\"" --set train.progress=false --set run.threads=1 >"$work/log" 2>&1; then
      cat "$work/log" >&2
      exit 1
    fi
    auc=$(grep '"split":"eval"' "$out/metrics.jsonl" | tail -1 | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["metrics"]["auc"])')
    echo "{\"variant\": \"$v\", \"seed\": $seed, \"auc\": $auc}"
  done
done
