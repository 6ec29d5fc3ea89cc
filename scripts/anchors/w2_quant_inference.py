"""W2 inference speed, side by side: TorchRec's DLRM with its tables quantized for inference
(int8 rows, fp32 dense) against trainrec's TorchScript serving files, in one process.

    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/w2_quant_inference.py --threads 1
    trainrec export RUN_DIR --format torchscript --quantize int8 --out /tmp/w2_int8.pt
    trainrec export RUN_DIR --format torchscript --out /tmp/w2_fp32.pt
    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/w2_quant_inference.py --threads 1 \
        --torchscript /tmp/w2_int8.pt --torchscript /tmp/w2_fp32.pt

(The venv: ../shared/bench/anchors/install.sh; the timing helpers are its common.py.)
Shape as w2_dlrm.py: 13 dense features, 26 sparse features, one table per feature of
100,000 x 64, dense arch [512,256,64], over arch [512,512,256,1], batch 2048, 1 id per feature
per example.

Part A: torchrec.models.dlrm.DLRM with random weights, eval(), torch.no_grad(), KJT input:
"torchrec_int8" is that model after torchrec.inference.modules.quantize_inference_model (the
path of TorchRec's inference example, torchrec/inference/dlrm_predict.py: EmbeddingBagCollection
-> QuantEmbeddingBagCollection, int8 row-wise tables in FBGEMM's IntNBit TBE, fp32 output);
"torchrec_fp32" the unquantized eager model. (TorchRec's fx-trace + torch.jit.script step after
quantizing needs shard_quant_model, which creates CUDA tensors; so TorchRec is timed eagerly.)
Part B (--torchscript PATH, repeatable): torch.jit.load(PATH); its feature_names / num_dense give
the inputs, built from the same random ids (ids < --rows) and dense values in the interface's
convention (dense [B, num_dense], ids[f] int64, lengths[f] int64 [B]); `forward` is timed (it
returns probabilities, TorchRec's DLRM logits; the sigmoid of [B, 1] is noise).
Every model runs --rounds rounds of --steps timed steps, the models interleaved round by round
so machine noise hits them alike; --warmup untimed steps precede each model's first round.
Prints one JSON line: per model the median samples/s (over all timed steps) and its ratio to
torchrec_int8.
"""

import argparse
import json
import os

import shared_anchors  # noqa: F401 (puts the shared common.py on sys.path)
from common import emit, env_info, log, rate, set_threads, summarize, time_steps  # noqa: E402

import torch  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--num-sparse", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ids-per-feature", type=int, default=1)
    p.add_argument("--dense-arch", default="512,256,64")
    p.add_argument("--over-arch", default="512,512,256,1")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-fp32", action="store_true", help="skip TorchRec's unquantized model")
    p.add_argument("--torchscript", action="append", default=[], metavar="PATH",
                   help="a trainrec TorchScript file to time (repeatable)")
    return p.parse_args()


def make_batches(a):
    """--num-batches of (dense [B, num_dense], ids [num_sparse, B * ids_per_feature]) from --seed."""
    gen = torch.Generator().manual_seed(a.seed)
    n = a.batch * a.ids_per_feature
    return [(torch.rand(a.batch, a.num_dense, generator=gen),
             torch.randint(0, a.rows, (a.num_sparse, n), generator=gen, dtype=torch.int64))
            for _ in range(a.num_batches)]


def torchrec_models(a, keys):
    import copy

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.models.dlrm import DLRM

    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=a.dim, num_embeddings=a.rows, feature_names=[k])
              for k in keys]
    fp32 = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
                dense_in_features=a.num_dense, dense_arch_layer_sizes=[int(x) for x in a.dense_arch.split(",")],
                over_arch_layer_sizes=[int(x) for x in a.over_arch.split(",")]).eval()
    int8 = quantize_inference_model(copy.deepcopy(fp32)).eval()  # swaps the EBC in place
    return int8, fp32


def main():
    a = parse()
    set_threads(a.threads)
    torch.manual_seed(a.seed)
    info = env_info()
    from torchrec import KeyedJaggedTensor

    keys = [f"cat_{i}" for i in range(a.num_sparse)]
    log("generating batches ...")
    raw = make_batches(a)
    lengths = torch.full((a.num_sparse * a.batch,), a.ids_per_feature, dtype=torch.int64)
    kjts = [(d, KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids.reshape(-1), lengths=lengths))
            for d, ids in raw]

    log("building TorchRec DLRM, quantize_inference_model ...")
    int8, fp32 = torchrec_models(a, keys)
    models = {"torchrec_int8": (int8, kjts, "eager")}
    if not a.no_fp32:
        models["torchrec_fp32"] = (fp32, kjts, "eager")
    else:
        del fp32
    meta = {}
    for path in a.torchscript:
        extra = {"trainrec.json": ""}
        m = torch.jit.load(path, map_location="cpu", _extra_files=extra)
        m.eval()
        feats, nd = list(m.feature_names), int(m.num_dense)
        if len(feats) != a.num_sparse or nd != a.num_dense:
            log(f"{path}: {len(feats)} features / {nd} dense, not {a.num_sparse} / {a.num_dense}: "
                "ids of feature f are the random ids of feature f % --num-sparse")
        inputs = []
        for d, ids in raw:
            dd = d[:, :nd] if nd <= a.num_dense else torch.cat([d, d[:, :1].expand(-1, nd - a.num_dense)], 1)
            ff = [ids[f % a.num_sparse].contiguous() for f in range(len(feats))]
            ll = [torch.full((a.batch,), a.ids_per_feature, dtype=torch.int64) for _ in feats]
            inputs.append((dd.contiguous(), ff, ll))
        name = f"torchscript:{os.path.basename(path)}"
        if name in models:
            name = f"torchscript:{path}"
        models[name] = (m, inputs, "torchscript")
        try:
            meta[name] = json.loads(extra["trainrec.json"] or "null")
        except ValueError:
            meta[name] = None
        meta[name] = {"path": path, "trainrec.json": meta[name], "num_features": len(feats), "num_dense": nd,
                      "task_names": list(m.task_names) if hasattr(m, "task_names") else None}

    times = {k: [] for k in models}
    with torch.no_grad():
        for r in range(a.rounds):
            for name, (m, inputs, kind) in models.items():
                i = [0]

                if kind == "eager":
                    def step(m=m, inputs=inputs):
                        d, kjt = inputs[i[0] % len(inputs)]
                        i[0] += 1
                        return m(d, kjt)
                else:
                    def step(m=m, inputs=inputs):
                        d, ids, ls = inputs[i[0] % len(inputs)]
                        i[0] += 1
                        return m(d, ids, ls)

                times[name] += time_steps(step, a.steps, a.warmup if r == 0 else 0)
                log(f"round {r} {name}: {a.batch * len(times[name]) / sum(times[name]):.0f} samples/s so far")

    base = rate(times["torchrec_int8"], a.batch)["median"]
    res = {"workload": "w2_quant_inference", "config": vars(a),
           "quantization_api": "torchrec.inference.modules.quantize_inference_model (int8 tables, fp32 dense)",
           "models": {}, "torchscript_meta": meta}
    for name, ts in times.items():
        sps = rate(ts, a.batch)
        res["models"][name] = {"samples_per_s": sps["median"], "samples_per_s_range": [sps["worst"], sps["best"]],
                               "step": summarize(ts), "vs_torchrec_int8": sps["median"] / base}
    emit(res, info)


if __name__ == "__main__":
    main()
