#!/usr/bin/env bash
# trainrec's side of the SASRec comparison with RecBole (scripts/anchors/recbole_sasrec.py):
# recipes/sequence/sasrec_movielens_100k.toml (ml-100k, leave-one-out, full ranking; the same
# sizes as RecBole's SASRec defaults) trained for EPOCHS epochs at batch BATCH on THREADS threads,
# once per seed. Prints one JSON line per seed (hr_at_10, ndcg_at_10, train seconds) like the
# RecBole script's, then the means and sample standard deviations.
# Usage: scripts/anchors/sasrec_seeds.sh [EPOCHS=3] [BATCH=256] [THREADS=1] [SEEDS="1 2 3 4 5"]
set -euo pipefail
EPOCHS=${1:-3}
BATCH=${2:-256}
THREADS=${3:-1}
SEEDS=${4:-"1 2 3 4 5"}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN="$ROOT/target/release/trainrec"
[ -x "$BIN" ] || cargo build --release -p trainrec --bin trainrec >&2
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for seed in $SEEDS; do
  OMP_NUM_THREADS=$THREADS "$BIN" run "$ROOT/recipes/sequence/sasrec_movielens_100k.toml" \
    --set run.seed="$seed" --set train.epochs="$EPOCHS" --set data.batch_size="$BATCH" \
    --set run.threads="$THREADS" --set train.log_every=1000 --set run.output_dir="\"$OUT/$seed\"" >"$OUT/$seed.log" 2>&1
  python3 - "$OUT/$seed" "$seed" "$EPOCHS" "$BATCH" "$THREADS" "$OUT/$seed.log" <<'PY'
import json, re, sys
run, seed, epochs, batch, threads, log = sys.argv[1:]
ev = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"split":"eval"' in l][-1]["metrics"]
secs = float(re.search(r"samples\) in ([0-9.]+) s", open(log).read()).group(1))
print(json.dumps({"seed": int(seed), "epochs": int(epochs), "batch": int(batch), "threads": int(threads),
                  "hit@10": round(ev["hr_at_10"], 6), "ndcg@10": round(ev["ndcg_at_10"], 6),
                  "hit@20": round(ev["hr_at_20"], 6), "ndcg@20": round(ev["ndcg_at_20"], 6),
                  "train_seconds": secs, "seconds_per_epoch": round(secs / int(epochs), 3)}), flush=True)
PY
done | tee "$OUT/all.jsonl"
python3 - "$OUT/all.jsonl" <<'PY'
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
out = {"summary": True, "seeds": [r["seed"] for r in rows]}
for k in ["hit@10", "ndcg@10", "seconds_per_epoch"]:
    v = [r[k] for r in rows]
    out[k + "_mean"] = round(st.mean(v), 6)
    out[k + "_std"] = round(st.stdev(v), 6) if len(v) > 1 else 0.0
print(json.dumps(out))
PY
