"""W1 "ec_fused_train": unpooled (sequence) embedding training step with a fused optimizer,
the EmbeddingCollection counterpart of ../shared/bench/anchors/w1_ebc_train.py and the
side-by-side anchor of `trainrec bench ec`.

One step = UNPOOLED forward of T tables (one feature each: one output row per id, no
pooling; per table a [batch * pooling, dim] output) + backward with a fixed random gradient
of that per-id output + the optimizer update fused into the backward (duplicate ids'
gradients summed per row, then one update per unique row).

  --impl tbe    fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen on CPU with
                pooling_mode=PoolingMode.NONE (EmbeddingLocation.HOST, ComputeDevice.CPU;
                update fused into backward). Output: one [T * batch * pooling, dim] tensor,
                table-major.
  --impl dmp    torchrec EmbeddingCollection + apply_optimizer_in_backward(RowWiseAdagrad
                | torch.optim.SGD | torch.optim.Adagrad) sharded by DistributedModelParallel
                on CPU (gloo, world size 1; sharding forced to --dmp-sharding, compute kernel
                "fused"). Output: per feature a JaggedTensor of [batch * pooling, dim] values;
                the backward takes the per-feature slices of the same gradient (no concat).

--optimizer rowwise_adagrad (default: EXACT_ROWWISE_ADAGRAD, s += mean(g^2),
w -= lr * g / (sqrt(s) + eps)), adagrad (EXACT_ADAGRAD, per element) or sgd (EXACT_SGD);
lr 0.01, eps 1e-8.

Ids: exactly --pooling ids per sample per feature, uniform or bounded Zipf(--alpha) (ranks
mapped to rows through a fixed random permutation per table), generated exactly as W1's
anchor does (same seed -> same ids). --num-batches distinct batches are pre-generated and
cycled through. The gradient is a fixed torch.randn(T * batch * pooling, dim) (seed + 1).

Prints one JSON line (W1's fields; see `results` below). --verify instead checks one step
of the chosen --impl/--optimizer on a tiny config against a NumPy reference (forward = the
looked-up rows; update = the exact optimizer on per-row summed gradients).

    PY=~/.cache/trainrec-anchors/venv/bin/python     # venv: ../shared/bench/anchors/install.sh
    $PY scripts/anchors/w1_ec_train.py --impl tbe --threads 1
    $PY scripts/anchors/w1_ec_train.py --impl dmp --threads 1
    $PY scripts/anchors/w1_ec_train.py --impl tbe --verify      # and --impl dmp, --optimizer ...

The timing helpers are the shared common.py (TRAINREC_ANCHORS_DIR overrides where it is).
"""

import argparse
import sys

import numpy as np

import shared_anchors  # noqa: F401 (puts the shared common.py on sys.path)
from common import emit, env_info, init_single_rank_gloo, log, rate, set_threads, summarize, time_steps  # noqa: E402

import torch  # noqa: E402

STATE_PER_ROW = {"rowwise_adagrad": lambda d: 1, "adagrad": lambda d: d, "sgd": lambda d: 0}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["tbe", "dmp"], default="tbe")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pooling", type=int, default=20, help="ids per sample per feature (sequence length)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fwd-steps", type=int, default=10, help="extra forward-only timed calls (0 = skip)")
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--optimizer", choices=list(STATE_PER_ROW), default="rowwise_adagrad")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = default)")
    p.add_argument("--bounds-check", choices=["default", "none", "warning", "fatal"], default="default",
                   help="tbe only: fbgemm BoundsCheckMode (default = fbgemm's default, WARNING)")
    p.add_argument("--dmp-sharding", default="table_wise",
                   help="dmp only: sharding type forced through planner constraints ('auto' = planner's choice)")
    p.add_argument("--verify", action="store_true")
    return p.parse_args()


# ---------------------------------------------------------------- data (as W1)
def make_ids(rng, T, rows, n, dist, alpha):
    """Returns a generator function producing int64 [T, n] id arrays."""
    if dist == "uniform":
        return lambda: rng.integers(0, rows, size=(T, n), dtype=np.int64)
    k = np.arange(1, rows + 1, dtype=np.float64)
    cdf = np.cumsum(k ** (-alpha))
    cdf /= cdf[-1]
    perms = np.stack([rng.permutation(rows) for _ in range(T)])

    def gen():
        u = rng.random((T, n))
        r = np.minimum(np.searchsorted(cdf, u, side="right"), rows - 1)
        return np.take_along_axis(perms, r, axis=1)

    return gen


def make_batches(a):
    """Batches of flat table-major ids [T * B * L], the offsets of the B*T sequences, the
    fixed per-id gradient [T * B * L, D], and each batch's mean unique rows per table."""
    rng = np.random.default_rng(a.seed)
    T, B, L = a.tables, a.batch, a.pooling
    gen = make_ids(rng, T, a.rows, B * L, a.dist, a.alpha)
    batches, uniq = [], []
    for _ in range(a.num_batches):
        ids = gen()  # [T, B*L]: feature f's B sequences of L ids, then the next feature
        uniq.append(float(np.mean([np.unique(ids[t]).size for t in range(T)])))
        batches.append(torch.from_numpy(np.ascontiguousarray(ids.reshape(-1))))
    offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)  # [T*B+1]
    g = torch.Generator().manual_seed(a.seed + 1)
    grad = torch.randn(T * B * L, a.dim, generator=g)
    return batches, offsets, grad, uniq


# ---------------------------------------------------------------- impls
# Each builder returns (fwd(ids, offsets) -> outputs, bwd(outputs, grad), weights(),
# set_weights(list of np arrays), meta).
def build_tbe(a):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    kw = {}
    if a.bounds_check != "default":
        kw["bounds_check_mode"] = {"none": BoundsCheckMode.NONE, "warning": BoundsCheckMode.WARNING,
                                   "fatal": BoundsCheckMode.FATAL}[a.bounds_check]
    opt = {"rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD, "adagrad": OptimType.EXACT_ADAGRAD,
           "sgd": OptimType.EXACT_SGD}[a.optimizer]
    emb = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(a.rows, a.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * a.tables,
        optimizer=opt,
        learning_rate=a.lr,
        eps=a.eps,
        pooling_mode=PoolingMode.NONE,
        device=torch.device("cpu"),
        **kw,
    )

    def fwd(ids, offsets):
        return emb(ids, offsets)  # [T*B*L, D]

    def bwd(out, grad):
        out.backward(grad)

    def weights():
        return [w.detach().clone().numpy() for w in emb.split_embedding_weights()]

    def set_weights(ws):
        for w, src in zip(emb.split_embedding_weights(), ws):
            w.detach().copy_(torch.from_numpy(src))

    return fwd, bwd, weights, set_weights, {"kernel": "SplitTableBatchedEmbeddingBagsCodegen",
                                            "pooling_mode": "NONE", "optimizer": opt.name,
                                            "bounds_check": str(emb.bounds_check_mode_int)}


def build_dmp(a):
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torch.distributed.optim import _apply_optimizer_in_backward

    pg = init_single_rank_gloo()
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=a.dim, num_embeddings=a.rows, feature_names=[f"f{i}"])
              for i in range(a.tables)]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ec = EmbeddingCollection(tables=tables, device=torch.device("meta"))

        def forward(self, kjt):
            return self.ec(kjt)

    m = M()
    opt_cls, opt_kw = {"rowwise_adagrad": (RowWiseAdagrad, {"lr": a.lr, "eps": a.eps}),
                       "adagrad": (torch.optim.Adagrad, {"lr": a.lr, "eps": a.eps}),
                       "sgd": (torch.optim.SGD, {"lr": a.lr})}[a.optimizer]
    _apply_optimizer_in_backward(opt_cls, m.ec.parameters(), opt_kw)
    sharders = [EmbeddingCollectionSharder()]
    plan = None
    if a.dmp_sharding != "auto":
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints

        cons = {f"t{i}": ParameterConstraints(sharding_types=[a.dmp_sharding], compute_kernels=["fused"])
                for i in range(a.tables)}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                           batch_size=a.batch, constraints=cons)
        plan = planner.collective_plan(m, sharders, pg)
    model = DistributedModelParallel(module=m, device=torch.device("cpu"), env=ShardingEnv.from_process_group(pg),
                                     plan=plan, sharders=sharders)
    keys = [f"f{i}" for i in range(a.tables)]
    lengths = torch.full((a.tables * a.batch,), a.pooling, dtype=torch.int64)
    BL = a.batch * a.pooling

    def fwd(ids, offsets):
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=lengths)
        out = model(kjt)  # (lazy) Dict[feature, JaggedTensor]
        return [out[k].values() for k in keys]  # T x [B*L, D]

    def bwd(outs, grad):
        torch.autograd.backward(outs, [grad[t * BL:(t + 1) * BL] for t in range(a.tables)])

    def _w():
        sd = model.state_dict()
        out = []
        for i in range(a.tables):
            t = sd[f"ec.embeddings.t{i}.weight"]
            if hasattr(t, "local_shards"):
                t = t.local_shards()[0].tensor
            out.append(t)
        return out

    def weights():
        return [t.detach().clone().numpy() for t in _w()]

    def set_weights(ws):
        for t, src in zip(_w(), ws):
            t.detach().copy_(torch.from_numpy(src))

    plan = {k: {p: (s.sharding_type, s.compute_kernel) for p, s in v.items()} for k, v in model.plan.plan.items()}
    # The FBGEMM kernels DMP built: (class, pooling mode, optimizer) of each, deduplicated.
    # (They sit in the sharded module's lookups, which are not registered submodules.)
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    tbes = sorted({(type(mod).__name__, PoolingMode(int(mod.pooling_mode)).name, str(mod.optimizer.name))
                   for lk in getattr(model.module.ec, "_lookups", []) for mod in lk.modules()
                   if type(mod).__name__.endswith("Codegen")})
    meta = {"plan": plan, "fused_optimizer": type(model.fused_optimizer).__name__, "optimizer": opt_cls.__name__,
            "fbgemm_kernels": [list(x) for x in tbes]}
    return fwd, bwd, weights, set_weights, meta


BUILDERS = {"tbe": build_tbe, "dmp": build_dmp}


# ---------------------------------------------------------------- verify
def reference_update(a, w0, ids_t, g_t):
    """Exact fused update of one table (float64): gradients of duplicate ids summed per row,
    optimizer state starting at 0, one update per unique row; other rows untouched."""
    gw = np.zeros((a.rows, a.dim), np.float64)
    np.add.at(gw, ids_t, g_t.astype(np.float64))
    ref = w0.astype(np.float64).copy()
    touched = np.unique(ids_t)
    g = gw[touched]
    if a.optimizer == "rowwise_adagrad":
        mom = (g ** 2).mean(axis=1)
        ref[touched] -= a.lr * g / (np.sqrt(mom)[:, None] + a.eps)
    elif a.optimizer == "adagrad":
        ref[touched] -= a.lr * g / (np.sqrt(g ** 2) + a.eps)
    else:
        ref[touched] -= a.lr * g
    return ref


def verify(a):
    a.tables, a.rows, a.dim, a.batch, a.pooling, a.num_batches = 3, 40, 8, 6, 5, 1
    batches, offsets, grad, _ = make_batches(a)
    fwd, bwd, weights, set_weights, meta = BUILDERS[a.impl](a)
    rng = np.random.default_rng(123)
    w0 = [rng.standard_normal((a.rows, a.dim)).astype(np.float32) for _ in range(a.tables)]
    set_weights(w0)
    BL = a.batch * a.pooling
    ids = batches[0].numpy().reshape(a.tables, BL)
    dup = int(sum(BL - np.unique(ids[t]).size for t in range(a.tables)))  # the test needs duplicates
    out = fwd(batches[0], offsets)
    got = out if isinstance(out, torch.Tensor) else torch.cat(out)
    ref_out = np.concatenate([w0[t][ids[t]] for t in range(a.tables)])
    fwd_err = float(np.abs(got.detach().numpy() - ref_out).max()) if got.shape == ref_out.shape else float("inf")
    bwd(out, grad)
    w1 = weights()
    g = grad.numpy()
    max_err = 0.0
    for t in range(a.tables):
        ref = reference_update(a, w0[t], ids[t], g[t * BL:(t + 1) * BL])
        max_err = max(max_err, float(np.abs(ref - w1[t]).max()))
    moved = float(max(np.abs(w1[t] - w0[t]).max() for t in range(a.tables)))
    ok = fwd_err < 1e-5 and max_err < 1e-5 and moved > 1e-4 and dup > 0
    print({"impl": a.impl, "optimizer": a.optimizer, "verify": "ok" if ok else "MISMATCH",
           "fwd_shape": list(got.shape), "fwd_max_abs_err": fwd_err, "update_max_abs_err": max_err,
           "max_abs_weight_change": moved, "duplicate_ids": dup,
           **{k: v for k, v in meta.items() if k != "plan"}})
    return 0 if ok else 1


# ---------------------------------------------------------------- main
def main():
    a = parse()
    set_threads(a.threads)
    torch.manual_seed(a.seed)
    if a.verify:
        return verify(a)
    info = env_info()
    log("generating batches ...")
    batches, offsets, grad, uniq = make_batches(a)
    log("building", a.impl, "...")
    fwd, bwd, _, _, meta = BUILDERS[a.impl](a)
    it = [0]

    def step():
        ids = batches[it[0] % len(batches)]
        it[0] += 1
        bwd(fwd(ids, offsets), grad)

    log("timing ...")
    ts = time_steps(step, a.steps, a.warmup)
    fwd_ts = None
    if a.fwd_steps > 0:  # forward-only (no autograd graph) for a fwd/bwd breakdown
        def fwd_only():
            ids = batches[it[0] % len(batches)]
            it[0] += 1
            with torch.no_grad():
                fwd(ids, offsets)

        fwd_ts = time_steps(fwd_only, a.fwd_steps, 1)
    T, B, L, D = a.tables, a.batch, a.pooling, a.dim
    lookups = T * B * L
    uniq_rows = float(np.mean(uniq)) * T
    spr = STATE_PER_ROW[a.optimizer](D)
    # Minimal bytes per step (fp32 weights and state, int64 ids): the forward reads each
    # looked-up row and its id and writes the row out; the backward + update reads the per-id
    # gradient and each id again, and reads + writes each unique row and its optimizer state.
    bytes_fwd = lookups * D * 4 + lookups * D * 4 + lookups * 8
    bytes_bwd = lookups * D * 4 + lookups * 8 + uniq_rows * (2 * D * 4 + 2 * 4 * spr)
    step_s = summarize(ts)
    fwd_s = summarize(fwd_ts) if fwd_ts else None
    res = {
        "workload": "w1_ec_fused_train", "impl": a.impl,
        "config": {k: v for k, v in vars(a).items() if k not in ("verify",)},
        "step": step_s,
        "fwd_only": fwd_s,
        "steps_per_s": rate(ts, 1.0),
        "samples_per_s": rate(ts, B),
        "unique_rows_per_step": uniq_rows,
        "unique_frac": uniq_rows / lookups,
        "min_bytes_per_step": bytes_fwd + bytes_bwd,
        "implied_GBps_at_median": (bytes_fwd + bytes_bwd) / step_s["median_s"] / 1e9,
        "fwd_implied_GBps_at_median": bytes_fwd / fwd_s["median_s"] / 1e9 if fwd_s else None,
        "meta": meta,
    }
    emit(res, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
