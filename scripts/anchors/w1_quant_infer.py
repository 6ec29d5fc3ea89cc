"""FBGEMM's CPU inference TBE (IntNBitTableBatchedEmbeddingBagsCodegen) on W1's forward pass,
fp32 / fp16 / int8 tables: the side-by-side anchor of `trainrec bench ebc --quant`.

    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/w1_quant_infer.py --threads 1
    target/release/trainrec bench ebc --steps 3 --warmup 1 --fwd-steps 10 --quant --threads 1

(The venv: ../shared/bench/anchors/install.sh.) Prints one JSON line: per precision the median
forward time, its ratio to fp32, and the tables' bytes.
"""

import argparse
import json
import statistics
import time

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--fwd-steps", type=int, default=10)
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)
    n = a.tables * a.batch * a.pooling
    batches = [
        (torch.randint(0, a.rows, (n,), generator=gen, dtype=torch.int32),
         torch.arange(0, n + 1, a.pooling, dtype=torch.int32))
        for _ in range(a.num_batches)
    ]
    out = {"workload": "w1_quant_infer", "impl": "fbgemm_intnbit_tbe_cpu", "config": vars(a), "precisions": {}}
    for name, st in [("fp32", SparseType.FP32), ("fp16", SparseType.FP16), ("int8", SparseType.INT8)]:
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(f"t{t}", a.rows, a.dim, st, EmbeddingLocation.HOST) for t in range(a.tables)],
            pooling_mode=PoolingMode.SUM,
            device="cpu",
            output_dtype=SparseType.FP32,
        )
        tbe.fill_random_weights()
        nbytes = sum(w.numel() * w.element_size() for w in tbe.split_embedding_weights_with_scale_bias(0)
                     for w in [w[0]])
        with torch.no_grad():
            for i in range(2):
                tbe(batches[i % len(batches)][0], batches[i % len(batches)][1])
            ts = []
            for i in range(a.fwd_steps):
                idx, off = batches[i % len(batches)]
                t = time.perf_counter()
                tbe(idx, off)
                ts.append(time.perf_counter() - t)
        out["precisions"][name] = {"fwd_median_s": statistics.median(ts), "bytes": nbytes}
        del tbe
    base = out["precisions"]["fp32"]
    for v in out["precisions"].values():
        v["time_vs_fp32"] = v["fwd_median_s"] / base["fwd_median_s"]
        v["bytes_vs_fp32"] = v["bytes"] / base["bytes"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
