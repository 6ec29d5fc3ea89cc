"""The reference side of scripts/device-check, on the GPU machine's torch (no network).

W1 (8 tables x 1M rows x 64, batch 4096, 20 ids per bag, sum pooling, exact row-wise Adagrad)
on the GPU with FBGEMM's table-batched embedding when fbgemm_gpu is importable, else with
torch's EmbeddingBag and the same row-wise Adagrad written in torch ops; and the GPU's copy
bandwidth (a device-to-device clone). Prints one JSON line.
"""

import argparse
import json
import statistics
import time

import torch


def copy_bandwidth(gib=4, reps=10):
    n = gib * (1 << 30) // 4
    x = torch.empty(n, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    # Read + write.
    return 2 * n * 4 / statistics.median(ts) / 1e9


def batches(a, gen):
    out = []
    for _ in range(a.num_batches):
        ids = torch.randint(0, a.rows, (a.tables, a.batch * a.pooling), generator=gen, dtype=torch.int64)
        out.append(ids.cuda())
    return out


def fbgemm_step_fn(a):
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        OptimType,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(a.rows, a.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for _ in range(a.tables)],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=a.lr,
        eps=a.eps,
    ).cuda()
    offsets = torch.arange(0, a.tables * a.batch * a.pooling + 1, a.pooling, dtype=torch.int64, device="cuda")

    def step(ids, grad):
        out = tbe(ids.view(-1), offsets)
        out.backward(grad)

    return "fbgemm_gpu TBE (exact row-wise Adagrad)", step


def torch_step_fn(a):
    tables = [torch.nn.EmbeddingBag(a.rows, a.dim, mode="sum", sparse=True).cuda() for _ in range(a.tables)]
    state = [torch.zeros(a.rows, device="cuda") for _ in range(a.tables)]
    offsets = torch.arange(0, a.batch * a.pooling, a.pooling, dtype=torch.int64, device="cuda")

    def step(ids, grad):
        g = grad.view(a.batch, a.tables, a.dim)
        for t, emb in enumerate(tables):
            out = emb(ids[t], offsets)
            out.backward(g[:, t])
            sg = emb.weight.grad.coalesce()
            rows, vals = sg.indices()[0], sg.values()
            with torch.no_grad():
                state[t].index_add_(0, rows, vals.pow(2).mean(1))
                mult = a.lr / (state[t][rows].sqrt() + a.eps)
                emb.weight.index_add_(0, rows, -mult[:, None] * vals)
            emb.weight.grad = None

    return "torch EmbeddingBag (sparse grads, row-wise Adagrad in torch ops)", step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    try:
        impl, step = fbgemm_step_fn(a)
    except Exception as e:  # no fbgemm_gpu on this machine
        impl, step = torch_step_fn(a)
        impl += f" [fbgemm_gpu unavailable: {type(e).__name__}]"
    bs = batches(a, gen)
    grad = torch.randn(a.batch, a.tables * a.dim, generator=gen).cuda()
    for i in range(a.warmup):
        step(bs[i % len(bs)], grad)
    torch.cuda.synchronize()
    ts = []
    for i in range(a.steps):
        t = time.perf_counter()
        step(bs[i % len(bs)], grad)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    med = statistics.median(ts)
    print(json.dumps({
        "workload": "w1_ebc_fused_train",
        "impl": impl,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "step": {"median_s": med, "min_s": min(ts), "max_s": max(ts), "n": len(ts)},
        "samples_per_s": {"median": a.batch / med},
        "copy_GBps": copy_bandwidth(),
    }))


if __name__ == "__main__":
    main()
