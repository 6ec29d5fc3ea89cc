#!/usr/bin/env python3
"""Trajectory fixture of TorchRec's position-weighted features: TorchRec's DLRM whose embedding
bag collection is a FeatureProcessedEmbeddingBagCollection (FP-EBC) with a
PositionWeightedModuleCollection, trained for 100 steps from seeded initial weights on fixed
batches. Writes `tests/fixtures/trajectory/dlrm_position_weighted.json`: the initial value of
every parameter (TorchRec names, position weights included), the batches and the loss of every
step, so a Rust test can load the same weights into trainrec, train on the same batches and
compare the per-step losses.

Model. DLRM(dense_in_features 3, dense_arch_layer_sizes [8, 4], over_arch_layer_sizes [8, 1]).
Tables t0/t1/t2: 20 rows x dim 4, sum pooling, one feature each (f0, f1, f2), in an
EmbeddingBagCollection with is_weighted=True (the FP-EBC requires it). The FP-EBC's processor is
PositionWeightedModuleCollection({"f0": 6, "f2": 6}): f0 and f2 are position weighted, f1 is not
(the collection gives unprocessed features weight 1; the dict-of-PositionWeightedModule form of
the FP-EBC would demand a processor for every feature). For an id at position p (0-based, within
its own bag) of feature f, the weight is position_weights[f][p], and the bag's pooled vector is
sum_p weight_p * table_row(id_p). A bag longer than max_feature_length is an error in TorchRec
(the gather of position 6 from a 6-entry weight is out of bounds), so no bag here is longer than 6.

DLRM's constructor reads `embedding_bag_configs()`, which the FP-EBC does not have, so DLRM is
built over the weighted EBC and its `sparse_arch.embedding_bag_collection` is then replaced by the
FP-EBC wrapping that same EBC; DLRM's own forward runs unchanged (SparseArch only calls the module
and reads the returned KeyedTensor).

Initial weights: torch.manual_seed(2026), then TorchRec's default init in construction order (the
tables, then DLRM's layers: the same tables and dense layers as dlrm.json), then the position
weights (TorchRec initialises them to 1) are set to 1 + 0.3 * randn(6) from the global RNG, f0
then f2, so the test exercises them.

Data (torch.Generator seed 7, batch 8, 100 batches): dense ~ randn (3 per example); key-major
lengths uniform in 0..=6 for every feature (empty bags included, none over the max length); ids
uniform in 0..20; label = [dense0 + 0.3 * (len(f0) > 2) + 0.4 * (f2's first id < 10) > 0.2 *
uniform noise].

Training: torch.optim.SGD lr 0.05 on every parameter (unsharded tables, dense gradients; the
position weights are ordinary dense parameters), mean binary cross-entropy with logits, the loss
recorded before each update. Beyond the losses, "final_params" holds every parameter after the
100 updates (the position weights move by about 1e-3, too little to show much in the losses). The
script also checks the position-weight semantics against a plain-PyTorch pooling of the first and
last batches and that the position weights get gradients and change during training.

Regenerate (from the repository root, with the TorchRec anchor venv; a few seconds on one core):

    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/position_weighted_fixture.py
"""
import importlib.metadata
import json
import os
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection  # noqa: E402
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "trajectory", "dlrm_position_weighted.json")
GENERATOR = "scripts/anchors/position_weighted_fixture.py"
ROWS, DIM, NUM_DENSE, BATCH, STEPS, LR = 20, 4, 3, 8, 100, 0.05
KEYS = ["f0", "f1", "f2"]
POSITION_WEIGHTED = {"f0": 6, "f2": 6}
MAX_BAG = 6
MODEL = {"kind": "dlrm", "dense_arch": [8, DIM], "over_arch": [8, 1]}


def make_model():
    """DLRM over an FP-EBC; call after torch.manual_seed."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[k])
              for i, k in enumerate(KEYS)]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("cpu"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                 dense_arch_layer_sizes=MODEL["dense_arch"], over_arch_layer_sizes=MODEL["over_arch"])
    fp = PositionWeightedModuleCollection(dict(POSITION_WEIGHTED), device=torch.device("cpu"))
    model.sparse_arch.embedding_bag_collection = FeatureProcessedEmbeddingBagCollection(ebc, fp)
    with torch.no_grad():
        for key in POSITION_WEIGHTED:
            assert torch.equal(fp.position_weights[key], torch.ones(POSITION_WEIGHTED[key]))  # TorchRec's init
            fp.position_weights[key].copy_(1.0 + 0.3 * torch.randn(POSITION_WEIGHTED[key]))
    return model


def batches(gen):
    out = []
    for _ in range(STEPS):
        dense = torch.randn(BATCH, NUM_DENSE, generator=gen)
        lengths = torch.randint(0, MAX_BAG + 1, (len(KEYS) * BATCH,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        noise = torch.rand(BATCH, generator=gen)
        # f2's bags start after f0's and f1's ids (key-major).
        f2_start = int(lengths[:2 * BATCH].sum())
        starts = f2_start + torch.cumsum(lengths[2 * BATCH:], 0) - lengths[2 * BATCH:]
        f2_first_low = torch.tensor([float(n > 0 and int(values[s]) < 10)
                                     for s, n in zip(starts.tolist(), lengths[2 * BATCH:].tolist())])
        # A label the model can learn: the first dense feature, f0's length, f2's first id.
        label = ((dense[:, 0] + 0.3 * (lengths[:BATCH] > 2).float() + 0.4 * f2_first_low) > 0.2 * noise).float()
        out.append({"dense": dense.reshape(-1).tolist(), "lengths": lengths.tolist(), "values": values.tolist(),
                    "labels": label.tolist()})
    return out


def inputs(b):
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=torch.tensor(b["values"]),
                                              lengths=torch.tensor(b["lengths"]))
    return torch.tensor(b["dense"]).view(BATCH, NUM_DENSE), kjt


@torch.no_grad()
def check_semantics(model, b):
    """TorchRec's pooled sparse output for batch `b` against a plain-PyTorch position-weighted sum."""
    fpebc = model.sparse_arch.embedding_bag_collection
    ebc, fp = fpebc._embedding_bag_collection, fpebc._feature_processors
    _, kjt = inputs(b)
    got = fpebc(kjt).to_dict()
    off = 0
    for k, key in enumerate(KEYS):
        table = ebc.embedding_bags[f"t{k}"].weight
        for e in range(BATCH):
            n = b["lengths"][k * BATCH + e]
            want = torch.zeros(DIM)
            for p in range(n):
                w = fp.position_weights[key][p] if key in POSITION_WEIGHTED else 1.0
                want += w * table[b["values"][off + p]]
            off += n
            assert torch.allclose(got[key][e], want, atol=1e-6), (key, e, got[key][e], want)


def main():
    torch.manual_seed(2026)
    model = make_model()
    params = {n: {"shape": list(p.shape), "values": p.detach().reshape(-1).tolist()}
              for n, p in model.named_parameters()}
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches(torch.Generator().manual_seed(7))
    all_lengths = [n for b in data for n in b["lengths"]]
    assert max(all_lengths) <= MAX_BAG and all_lengths.count(0) > 0
    check_semantics(model, data[0])

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, b in enumerate(data):
        dense, kjt = inputs(b)
        logits = model(dense_features=dense, sparse_features=kjt).view(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(b["labels"]))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for n, p in model.named_parameters():
                if "position_weights" in n:
                    assert p.grad is not None and p.grad.abs().sum() > 0, n
                    print("step 0 grad", n, [round(g, 6) for g in p.grad.tolist()])
        opt.step()
        losses.append(loss.item())

    for n, p in model.named_parameters():
        if "position_weights" in n:
            delta = (p.detach() - initial[n]).abs()
            assert delta.max() > 0, n
            print("position weight", n, "initial", [round(v, 4) for v in initial[n].tolist()],
                  "final", [round(v, 4) for v in p.detach().tolist()], "max |delta|", round(delta.max().item(), 5))
    check_semantics(model, data[-1])  # again with the trained weights

    doc = {"generator": GENERATOR, "torchrec": importlib.metadata.version("torchrec"), "torch": torch.__version__,
           "model": MODEL, "rows": ROWS, "dim": DIM, "num_dense": NUM_DENSE, "batch": BATCH, "lr": LR,
           "keys": KEYS, "position_weighted": POSITION_WEIGHTED, "params": params, "batches": data,
           "losses": losses,
           "final_params": {n: {"shape": list(p.shape), "values": p.detach().reshape(-1).tolist()}
                            for n, p in model.named_parameters()}}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".tmp", "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(OUT + ".tmp", OUT)
    print("losses", losses[0], "->", losses[-1])
    print("params", [(n, v["shape"]) for n, v in params.items()])


if __name__ == "__main__":
    main()
