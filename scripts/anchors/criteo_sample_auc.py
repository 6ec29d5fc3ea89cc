#!/usr/bin/env python3
"""TorchRec's DLRM on the Criteo sample split of issue 34, over several seeds: the anchor side of
`scripts/criteo-sample-fidelity` (which runs trainrec on the same files and prints both).

Reads the `trainrec convert criteo-binary` files of the first 9,000 rows (prefix `train`) and the
last 1,000 (prefix `test`) in DIR: dense features as written (ln(1 + max(x, 0))), ids
`value % 100000`. Model: `torchrec.models.dlrm.DLRM` over 26 tables of 100,000 x 16 (one per
feature), dense arch [64, 16], over arch [64, 32, 1]; element-wise Adagrad (lr 0.05, eps 1e-10)
on every parameter; batch 256 in file order; 3 epochs; AUC on the test rows. Prints one JSON
line per seed, then one with the mean and standard deviation.

Usage: ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/criteo_sample_auc.py DIR [--seeds 10]
"""
import argparse
import json
import statistics

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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--seeds", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(1)
    aucs = []
    for seed in range(a.seeds):
        aucs.append(run(a.dir, seed))
        print(json.dumps({"framework": "torchrec", "seed": seed, "auc": aucs[-1]}), flush=True)
    print(json.dumps({"framework": "torchrec", "seeds": a.seeds, "mean": statistics.mean(aucs),
                      "std": statistics.stdev(aucs) if len(aucs) > 1 else 0.0}))


if __name__ == "__main__":
    main()
