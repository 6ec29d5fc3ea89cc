#!/usr/bin/env python3
"""Trajectory fixtures of issue 34: TorchRec trains DLRM, DLRM-DCN and DeepFM for 100 steps from
seeded initial weights on fixed batches, and records the initial weights (TorchRec names), the
batches and the loss of every step. `tests/trajectory.rs` loads the same weights into trainrec's
job, trains on the same batches and compares the per-step losses.

Setup (one per model): 3 tables of 20 x 4 (one feature each, sum pooling, 0-3 ids per bag),
3 dense features, batch 8, 100 steps; SGD lr 0.05 on every parameter (the tables' SGD is
trainrec's fused `sgd`, which sums each row's gradients as the dense gradient of an
EmbeddingBag weight does); loss: mean binary cross-entropy with logits. SimpleDeepFMNN ends in a
Sigmoid: it is replaced by an Identity so the model returns the logit (trainrec's DeepFM does).

`losses_bf16`: the same model from the same initial weights on the same batches, its forward under
`torch.autocast("cpu", dtype=torch.bfloat16)` (the loss on the fp32 logits, the backward after the
region), as trainrec's `train.dense_precision = "bf16"` trains.

Regenerate (from the repository root, with the TorchRec anchor venv of ../shared/bench/anchors):

    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/trajectory_fixture.py
"""
import importlib.metadata
import json
import os

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "trajectory")
ROWS, DIM, NUM_DENSE, BATCH, STEPS, LR = 20, 4, 3, 8, 100, 0.05
KEYS = ["f0", "f1", "f2"]


def ebc():
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[k])
              for i, k in enumerate(KEYS)]
    return EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


def models():
    yield "dlrm", {"kind": "dlrm", "dense_arch": [8, DIM], "over_arch": [8, 1]}, lambda: DLRM(
        embedding_bag_collection=ebc(), dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[8, DIM], over_arch_layer_sizes=[8, 1])
    yield "dlrm_dcn", {"kind": "dlrm_dcn", "dense_arch": [8, DIM], "over_arch": [8, 1], "dcn_num_layers": 2,
                       "dcn_low_rank_dim": 3}, lambda: DLRM_DCN(
        embedding_bag_collection=ebc(), dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[8, DIM],
        over_arch_layer_sizes=[8, 1], dcn_num_layers=2, dcn_low_rank_dim=3)

    def deepfm():
        m = SimpleDeepFMNN(num_dense_features=NUM_DENSE, embedding_bag_collection=ebc(), hidden_layer_size=8,
                           deep_fm_dimension=5)
        assert isinstance(m.over_arch.model[1], nn.Sigmoid)
        m.over_arch.model[1] = nn.Identity()
        return m
    yield "deepfm", {"kind": "deepfm", "hidden_layer_size": 8, "deep_fm_dimension": 5}, deepfm


def batches(gen):
    out = []
    for _ in range(STEPS):
        dense = torch.randn(BATCH, NUM_DENSE, generator=gen)
        lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        # A label the model can learn: the first dense feature and whether f0 has two ids or more.
        noise = torch.rand(BATCH, generator=gen)
        label = ((dense[:, 0] + 0.3 * (lengths[:BATCH] > 1).float()) > 0.2 * noise).float()
        out.append({"dense": dense.reshape(-1).tolist(), "lengths": lengths.tolist(), "values": values.tolist(),
                    "labels": label.tolist()})
    return out


def train(model, data, bf16):
    """SGD on every parameter over `data`; the per-step losses."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for b in data:
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=torch.tensor(b["values"]),
                                                  lengths=torch.tensor(b["lengths"]))
        dense = torch.tensor(b["dense"]).view(BATCH, NUM_DENSE)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(dense_features=dense, sparse_features=kjt).view(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), torch.tensor(b["labels"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, config, make in models():
        torch.manual_seed(2026)
        model = make()
        params = {n: {"shape": list(p.shape), "values": p.detach().reshape(-1).tolist()}
                  for n, p in model.named_parameters()}
        data = batches(torch.Generator().manual_seed(7))
        losses = train(model, data, bf16=False)
        torch.manual_seed(2026)
        losses_bf16 = train(make(), data, bf16=True)
        doc = {"generator": "scripts/anchors/trajectory_fixture.py",
               "torchrec": importlib.metadata.version("torchrec"), "torch": torch.__version__,
               "model": config, "rows": ROWS, "dim": DIM, "num_dense": NUM_DENSE, "batch": BATCH, "lr": LR,
               "keys": KEYS, "params": params, "batches": data, "losses": losses,
               "losses_bf16": losses_bf16}
        path = os.path.join(OUT, f"{name}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(path + ".tmp", path)
        print(name, "losses", losses[0], "->", losses[-1], "bf16", losses_bf16[0], "->", losses_bf16[-1],
              "params", sorted(params))


if __name__ == "__main__":
    main()
