"""Loads a `trainrec export` file into a TorchRec EmbeddingBagCollection of the same tables and
checks its forward pass against pooling computed here from the exported rows.

    trainrec run recipes/checkpoints/quickstart_checkpointed.toml --set train.steps=250
    trainrec export runs/quickstart_checkpointed --out /tmp/model.safetensors
    ~/.cache/trainrec-anchors/venv/bin/python tests/python/load_export.py /tmp/model.safetensors

Needs torch, torchrec and safetensors (the anchors venv: ../shared/bench/anchors/install.sh,
then `pip install safetensors`). Prints one line per table and exits non-zero on a mismatch.
"""

import sys
import tomllib

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType


def main(path: str) -> int:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    recipe = tomllib.loads(meta["recipe"])
    tensors = load_file(path)
    configs = []
    for t in recipe["tables"]:
        features = [f.split("@")[0] for f in t["features"]]
        pooling = PoolingType.MEAN if t.get("pooling", "sum") == "mean" else PoolingType.SUM
        configs.append(
            EmbeddingBagConfig(
                name=t["name"], embedding_dim=t["dim"], num_embeddings=t["rows"],
                feature_names=features, pooling=pooling,
            )
        )
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    state = {k: v for k, v in tensors.items() if k.startswith("embedding_bags.")}
    # strict: every table of the EBC is in the file, with its shape, and nothing else is.
    ebc.load_state_dict(state, strict=True)

    gen = torch.Generator().manual_seed(0)
    keys = [f for c in configs for f in c.feature_names]
    rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
    batch = 16
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.cat([
        torch.randint(0, rows[k], (int(lengths[i * batch:(i + 1) * batch].sum()),), generator=gen)
        for i, k in enumerate(keys)
    ])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    out = ebc(kjt).to_dict()
    failed = 0
    for c in configs:
        w = tensors[f"embedding_bags.{c.name}.weight"]
        for f in c.feature_names:
            jt = kjt[f]
            want = torch.zeros(batch, c.embedding_dim)
            for i, ids in enumerate(jt.to_dense()):
                if len(ids):
                    pooled = w[ids].sum(0)
                    want[i] = pooled / len(ids) if c.pooling == PoolingType.MEAN else pooled
            err = (out[f] - want).abs().max().item()
            ok = err < 1e-5
            failed += not ok
            print(f"{c.name}/{f}: rows {c.num_embeddings} dim {c.embedding_dim} max error {err:.2e} {'ok' if ok else 'MISMATCH'}")
    dense = [k for k in tensors if k.startswith("dense.")]
    print(f"{len(state)} tables loaded into torchrec.EmbeddingBagCollection, {len(dense)} dense tensors")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
