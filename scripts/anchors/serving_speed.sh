#!/usr/bin/env bash
# W2 serving speed, side by side on this machine (issue 33): TorchRec 1.9.2's DLRM with int8
# inference tables (quantize_inference_model) against trainrec's TorchScript exports of the same
# shape scored in Python, and `trainrec bench dlrm --mode infer --quantize int8` (the lookups and
# dense model `trainrec eval --quantize int8` runs) against the same TorchRec numbers.
#
#   scripts/anchors/serving_speed.sh [ROUNDS]      (default 3; needs target/release/trainrec and
#                                                   the anchors venv: ../shared/bench/anchors/install.sh)
#
# Trains recipes/serving/w2_dlrm.toml for 20 steps into a temporary run directory, exports it as
# fp32 and int8 TorchScript, then alternates, ROUNDS times: the Python script (TorchRec int8,
# TorchRec fp32, both TorchScript files, interleaved) and trainrec's int8 / fp32 inference
# bench, all at batch 2048 on 1 thread. Prints every JSON line, then one summary line of ratios
# (medians over rounds).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
rounds="${1:-3}"
bin="${TRAINREC_BIN:-target/release/trainrec}"
py="${TRAINREC_TORCH_PYTHON:-$HOME/.cache/trainrec-anchors/venv/bin/python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
"$bin" run recipes/serving/w2_dlrm.toml --set "run.output_dir=\"$work/run\"" --set train.steps=20 \
  --set train.eval_every=20 --set run.threads=1 >&2
"$bin" export "$work/run" --out "$work/w2_int8.pt" --quantize int8 >&2
"$bin" export "$work/run" --out "$work/w2_fp32.pt" >&2
out="$work/lines.jsonl"
for r in $(seq 1 "$rounds"); do
  "$py" scripts/anchors/w2_quant_inference.py --threads 1 --rounds 1 \
    --torchscript "$work/w2_int8.pt" --torchscript "$work/w2_fp32.pt" | tail -1 | tee -a "$out"
  "$bin" bench dlrm --mode infer --quantize int8 --threads 1 --steps 10 --warmup 3 | tail -1 | tee -a "$out"
  "$bin" bench dlrm --mode infer --threads 1 --steps 10 --warmup 3 | tail -1 | tee -a "$out"
done
"$py" - "$out" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def median(xs):
    return statistics.median(xs) if xs else None
py = [l for l in lines if l.get("workload") != "w2_dlrm"]
tr = [l for l in lines if l.get("workload") == "w2_dlrm"]
def models(key):
    out = []
    for l in py:
        for name, m in l.get("models", {}).items():
            if key(name):
                out.append(m.get("samples_per_s") or m.get("median_samples_per_s"))
    return [x for x in out if x]
torchrec_int8 = median(models(lambda n: n == "torchrec_int8"))
torchrec_fp32 = median(models(lambda n: n == "torchrec_fp32"))
ts_int8 = median(models(lambda n: "int8" in n and n.startswith("torchscript")))
ts_fp32 = median(models(lambda n: "fp32" in n and n.startswith("torchscript")))
def rate(l):
    return (l.get("samples_per_s") or {}).get("median")
bench_int8 = median([rate(l) for l in tr if l.get("config", {}).get("quantize") == "int8" and rate(l)])
bench_fp32 = median([rate(l) for l in tr if l.get("config", {}).get("quantize") is None and rate(l)])
ratio = lambda a, b: round(a / b, 3) if a and b else None
print(json.dumps({
    "summary": "w2_serving", "rounds": len(tr) // 2, "samples_per_s": {
        "torchrec_int8": torchrec_int8, "torchrec_fp32": torchrec_fp32,
        "torchscript_int8": ts_int8, "torchscript_fp32": ts_fp32,
        "trainrec_infer_int8": bench_int8, "trainrec_infer_fp32": bench_fp32},
    "torchscript_int8_vs_torchrec_int8": ratio(ts_int8, torchrec_int8),
    "trainrec_infer_int8_vs_torchrec_int8": ratio(bench_int8, torchrec_int8),
}))
PY
