#!/usr/bin/env python3
"""The DLRM fidelity comparison of issue 34 on the shared Criteo sample: TorchRec and trainrec
train the same model on the same rows over several seeds, and the held-out AUCs are compared.

With `--tsv FILE` the script splits it (the first 9,000 rows train, the last 1,000 test) and
converts both parts with `trainrec convert criteo-binary` into DIR; both frameworks then read
those files: dense features as written (ln(1 + max(x, 0))), ids `value % 100000`. Model: `torchrec.models.dlrm.DLRM` over 26 tables of 100,000 x 16 (one per
feature), dense arch [64, 16], over arch [64, 32, 1]; element-wise Adagrad (lr 0.05, eps 1e-10)
on every parameter; batch 256 in file order; 3 epochs; AUC on the test rows. trainrec
(`--trainrec BIN`) runs the same setup from a generated recipe. Prints one JSON line per
framework and seed, then each framework's mean and standard deviation.

Usage: ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/criteo_sample_auc.py DIR \
           --tsv ../shared/data/criteo-kaggle-sample/train_examples.txt --trainrec ./target/release/trainrec [--seeds 10]
"""
import argparse
import json
import os
import statistics
import subprocess

import numpy as np
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

ROWS, DIM, BATCH, EPOCHS, LR = 100_000, 16, 256, 3, 0.05
KEYS = [f"C{i}" for i in range(1, 27)]


def load(d, prefix):
    dense = torch.from_numpy(np.load(f"{d}/{prefix}_dense.npy"))
    sparse = torch.from_numpy(np.load(f"{d}/{prefix}_sparse.npy") % ROWS)
    labels = torch.from_numpy(np.load(f"{d}/{prefix}_labels.npy").astype(np.float32)).view(-1)
    return dense, sparse, labels


def kjt(sparse):
    b = sparse.shape[0]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=sparse.t().reshape(-1), lengths=torch.ones(26 * b, dtype=torch.int32)
    )


def auc(scores, labels):
    order = torch.argsort(scores, descending=True)
    y = labels[order]
    pos, neg = y.sum(), (1 - y).sum()
    # Rank statistic with ties broken by order (the test scores are continuous).
    tp = torch.cumsum(y, 0)
    return float(((1 - y) * tp).sum() / (pos * neg)) if pos > 0 and neg > 0 else float("nan")


def run(d, seed):
    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[k]) for k in KEYS]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, DIM],
        over_arch_layer_sizes=[64, 32, 1],
    )
    opt = torch.optim.Adagrad(model.parameters(), lr=LR, eps=1e-10)
    dense, sparse, labels = load(d, "train")
    for _ in range(EPOCHS):
        for s in range(0, len(labels), BATCH):
            logits = model(dense[s : s + BATCH], kjt(sparse[s : s + BATCH])).view(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[s : s + BATCH])
            opt.zero_grad()
            loss.backward()
            opt.step()
    dense, sparse, labels = load(d, "test")
    with torch.no_grad():
        scores = torch.sigmoid(model(dense, kjt(sparse)).view(-1))
    return auc(scores, labels)


def prepare(d, tsv, trainrec):
    os.makedirs(d, exist_ok=True)
    lines = open(tsv).read().splitlines(keepends=True)
    for name, part in [("train", lines[:9000]), ("test", lines[9000:10000])]:
        with open(f"{d}/{name}.txt", "w") as f:
            f.writelines(part)
        subprocess.run([trainrec, "convert", "criteo-binary", f"{d}/{name}.txt", d, "--prefix", name],
                       check=True, capture_output=True)


def recipe(d):
    t = ["# Fidelity comparison (scripts/anchors/criteo_sample_auc.py).",
         "# Run:      see the script", "# Override: none",
         '[run]\nname = "fidelity"', "[data]\nbatch_size = 256\neval_batch_size = 1000",
         f'[data.sampler]\nkind = "criteo_binary"\ndir = "{d}"\ntrain = ["train"]\neval = ["test"]']
    t += [f'[[tables]]\nname = "t_{k}"\nfeatures = ["{k}"]\nrows = {ROWS}\ndim = {DIM}' for k in KEYS]
    t += ['[model]\nkind = "dlrm"\ndense_arch = [64, 16]\nover_arch = [64, 32, 1]',
          f'[optimizer]\nsparse = {{ kind = "adagrad", lr = {LR}, eps = 1e-10 }}\ndense = {{ kind = "adagrad", lr = {LR} }}',
          f"[train]\nepochs = {EPOCHS}\nlog_every = 1000\nprogress = false", '[[metrics]]\nkind = "auc"']
    path = f"{d}/fidelity.toml"
    with open(path, "w") as f:
        f.write("\n".join(t) + "\n")
    return path


def run_trainrec(trainrec, path, d, seed):
    out = f"{d}/runs/seed{seed}"
    subprocess.run([trainrec, "run", path, "--set", f"run.seed={seed}", "--set", f'run.output_dir="{out}"',
                    "--set", "run.threads=1"], check=True, capture_output=True)
    lines = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    return [l for l in lines if l["split"] == "eval"][-1]["metrics"]["auc"]


def summary(name, aucs):
    print(json.dumps({"framework": name, "seeds": len(aucs), "mean": statistics.mean(aucs),
                      "std": statistics.stdev(aucs) if len(aucs) > 1 else 0.0}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--tsv", help="split and convert this Criteo TSV into DIR first")
    p.add_argument("--trainrec", help="also run this trainrec binary")
    a = p.parse_args()
    d = os.path.abspath(a.dir)
    if a.tsv:
        prepare(d, a.tsv, a.trainrec or "trainrec")
    torch.set_num_threads(1)
    results = {"torchrec": []}
    if a.trainrec:
        results["trainrec"] = []
        path = recipe(d)
    for seed in range(a.seeds):
        results["torchrec"].append(run(d, seed))
        print(json.dumps({"framework": "torchrec", "seed": seed, "auc": results["torchrec"][-1]}), flush=True)
        if a.trainrec:
            results["trainrec"].append(run_trainrec(a.trainrec, path, d, seed))
            print(json.dumps({"framework": "trainrec", "seed": seed, "auc": results["trainrec"][-1]}), flush=True)
    for name, aucs in results.items():
        summary(name, aucs)


if __name__ == "__main__":
    main()
