#!/usr/bin/env python3
"""bf16 dense compute against fp32, paired by seed: trains each recipe once per seed with
`train.dense_precision = "fp32"` and once with `"bf16"` (same data, same initial weights) and
compares the final eval AUCs. Prints one JSON line per run, then per recipe the mean AUC of each
precision and the mean and largest |bf16 - fp32| over the seeds.

Usage: scripts/bf16_quality.py --trainrec target/release/trainrec [--seeds 5] \
           [--recipe recipes/quickstart.toml --recipe recipes/criteo/kaggle_sample.toml]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile


def final_auc(run_dir):
    auc = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row.get("split") == "eval" and "auc" in row["metrics"]:
                auc = row["metrics"]["auc"]
    if auc is None:
        raise SystemExit(f"{run_dir}: no eval AUC in metrics.jsonl")
    return auc


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainrec", required=True)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--recipe", action="append")
    a = p.parse_args()
    recipes = a.recipe or ["recipes/quickstart.toml", "recipes/criteo/kaggle_sample.toml"]
    summary = {}
    with tempfile.TemporaryDirectory(prefix="trainrec-bf16-quality-") as tmp:
        for recipe in recipes:
            got = {"fp32": [], "bf16": []}
            for seed in range(1, a.seeds + 1):
                for precision in ("fp32", "bf16"):
                    out = os.path.join(tmp, f"{os.path.basename(recipe)}-{seed}-{precision}")
                    subprocess.run([a.trainrec, "run", recipe, "--set", f"run.seed={seed}",
                                    "--set", f"train.dense_precision=\"{precision}\"",
                                    "--set", f"run.output_dir=\"{out}\"", "--set", "train.progress=false",
                                    "--log-level", "warn"], check=True, stdout=subprocess.DEVNULL)
                    auc = final_auc(out)
                    got[precision].append(auc)
                    print(json.dumps({"recipe": recipe, "seed": seed, "precision": precision, "auc": auc}), flush=True)
            diffs = [abs(b - f) for f, b in zip(got["fp32"], got["bf16"])]
            summary[recipe] = {
                "seeds": a.seeds,
                "auc_fp32_mean": statistics.mean(got["fp32"]),
                "auc_bf16_mean": statistics.mean(got["bf16"]),
                "mean_bf16_minus_fp32": statistics.mean(b - f for f, b in zip(got["fp32"], got["bf16"])),
                "mean_abs_diff": statistics.mean(diffs),
                "max_abs_diff": max(diffs),
            }
    print(json.dumps({"summary": summary}, indent=1))


if __name__ == "__main__":
    main()
