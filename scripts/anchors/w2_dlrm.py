"""trainrec's copy of ../shared/bench/anchors/w2_dlrm.py with one flag added, `--autocast bf16`:
every forward (train: the DLRMTrain forward and its loss; infer: the logits) runs under
`torch.autocast("cpu", dtype=torch.bfloat16)`, the backward after it, as PyTorch's AMP recipe
does; the dense parameters and optimizer stay fp32. `--autocast none` (the default) is the
original script. The timing helpers are the shared common.py (TRAINREC_ANCHORS_DIR overrides
where it is).

    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/w2_dlrm.py --mode train --threads 1 --autocast bf16

W2 "dlrm_train": torchrec.models.dlrm.DLRM (wrapped in DLRMTrain, BCE-with-logits) on CPU.

Defaults (Criteo-like): 13 dense features, 26 sparse features, one table per feature of
100,000 x 64, dense arch [512,256,64], over arch [512,512,256,1], batch 2048, 1 id per
feature per sample. Data: torchrec.datasets.random.RandomRecDataset, --num-batches batches
pre-generated before timing and cycled.

  --sparse dmp    EBC on meta, apply_optimizer_in_backward(RowWiseAdagrad) -> fused
                  EXACT_ROWWISE_ADAGRAD in fbgemm TBE; sharded by DistributedModelParallel on
                  CPU (gloo, world 1); sharding forced by planner constraints (--sharding,
                  'auto' lets the planner choose); dense params: --dense-opt via KeyedOptimizerWrapper.
  --sparse plain  unsharded EBC (nn.EmbeddingBag, dense grads) + one torch optimizer
                  (--dense-opt) over all params.

--mode train: loss.backward + optimizer step per step. --mode infer: model.eval(),
torch.no_grad(), logits of the inner DLRM only. Prints one JSON line.
"""

import argparse

import shared_anchors  # noqa: F401 (puts the shared common.py on sys.path)
from common import emit, env_info, init_single_rank_gloo, log, rate, set_threads, summarize, time_steps  # noqa: E402

import torch  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["train", "infer"], default="train")
    p.add_argument("--sparse", choices=["dmp", "plain"], default="dmp")
    p.add_argument("--sharding", default="table_wise", help="dmp: forced sharding type, or 'auto'")
    p.add_argument("--dense-opt", choices=["adagrad", "adam", "sgd"], default="adagrad")
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--num-sparse", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ids-per-feature", type=int, default=1)
    p.add_argument("--dense-arch", default="512,256,64")
    p.add_argument("--over-arch", default="512,512,256,1")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--autocast", choices=["none", "bf16"], default="none",
                   help="run the forwards under torch.autocast('cpu', dtype=torch.bfloat16)")
    return p.parse_args()


def dense_opt_factory(a):
    if a.dense_opt == "adagrad":
        return lambda params: torch.optim.Adagrad(params, lr=a.lr, eps=a.eps)
    if a.dense_opt == "adam":
        return lambda params: torch.optim.Adam(params, lr=a.lr)
    return lambda params: torch.optim.SGD(params, lr=a.lr)


def main():
    a = parse()
    set_threads(a.threads)
    torch.manual_seed(a.seed)
    info = env_info()

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.datasets.random import RandomRecDataset
    from torchrec.models.dlrm import DLRM, DLRMTrain

    keys = [f"cat_{i}" for i in range(a.num_sparse)]
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=a.dim, num_embeddings=a.rows, feature_names=[k])
              for k in keys]
    log("generating batches ...")
    ds = RandomRecDataset(keys=keys, batch_size=a.batch, hash_size=a.rows, ids_per_feature=a.ids_per_feature,
                          num_dense=a.num_dense, manual_seed=a.seed, num_generated_batches=a.num_batches)
    it = iter(ds)
    batches = [next(it) for _ in range(a.num_batches)]
    dense_arch = [int(x) for x in a.dense_arch.split(",")]
    over_arch = [int(x) for x in a.over_arch.split(",")]
    cpu = torch.device("cpu")

    log("building", a.sparse, "...")
    meta = {}
    if a.sparse == "dmp":
        from torch.distributed.optim import _apply_optimizer_in_backward
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        pg = init_single_rank_gloo()
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        train_model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=a.num_dense,
                                     dense_arch_layer_sizes=dense_arch, over_arch_layer_sizes=over_arch,
                                     dense_device=cpu))
        _apply_optimizer_in_backward(RowWiseAdagrad, train_model.model.sparse_arch.parameters(),
                                     {"lr": a.lr, "eps": a.eps})
        sharders = [EmbeddingBagCollectionSharder()]
        plan = None
        if a.sharding != "auto":
            from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
            from torchrec.distributed.planner.types import ParameterConstraints

            cons = {t.name: ParameterConstraints(sharding_types=[a.sharding]) for t in tables}
            planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                               batch_size=a.batch, constraints=cons)
            plan = planner.collective_plan(train_model, sharders, pg)
        model = DistributedModelParallel(module=train_model, device=cpu, env=ShardingEnv.from_process_group(pg),
                                         plan=plan, sharders=sharders)
        dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                          dense_opt_factory(a))
        opt = CombinedOptimizer([model.fused_optimizer, dense_opt])
        kinds = {}
        for _, mp in model.plan.plan.items():
            for _, s in mp.items():
                kinds[f"{s.sharding_type}/{s.compute_kernel}"] = kinds.get(f"{s.sharding_type}/{s.compute_kernel}", 0) + 1
        meta["plan_kinds"] = kinds
        inner = model.module.model  # unwrapped DLRM (sharded EBC inside)
    else:
        ebc = EmbeddingBagCollection(tables=tables, device=cpu)
        model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=a.num_dense,
                               dense_arch_layer_sizes=dense_arch, over_arch_layer_sizes=over_arch, dense_device=cpu))
        opt = dense_opt_factory(a)(model.parameters())
        inner = model.model
    meta["dense_params"] = sum(p.numel() for n, p in model.named_parameters() if "embedding" not in n)

    def amp():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast == "bf16")

    i = [0]
    if a.mode == "train":
        model.train()

        def step():
            b = batches[i[0] % len(batches)]
            i[0] += 1
            with amp():
                loss, _ = model(b)
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        model.eval()

        def step():
            b = batches[i[0] % len(batches)]
            i[0] += 1
            with torch.no_grad(), amp():
                logits = inner(b.dense_features, b.sparse_features)
            return logits

    log("timing ...")
    ts = time_steps(step, a.steps, a.warmup)
    res = {"workload": "w2_dlrm", "mode": a.mode, "sparse": a.sparse, "config": vars(a),
           "step": summarize(ts), "samples_per_s": rate(ts, a.batch), "meta": meta}
    emit(res, info)


if __name__ == "__main__":
    main()
