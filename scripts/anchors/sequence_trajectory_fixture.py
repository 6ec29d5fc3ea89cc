#!/usr/bin/env python3
"""Reference training trajectories of trainrec's sequence models (SASRec, DIN) over TorchRec's
EmbeddingCollection, one per table optimizer: `tests/fixtures/trajectory/{sasrec,din}_{sgd,adagrad,
rowwise_adagrad,adam}.json`. Each records the initial table weights and dense parameters (under
trainrec's parameter names), 100 fixed batches and the loss of every step; a Rust test loads the
same weights into trainrec, trains on the same batches and compares the per-step losses.

Setup. Batch 8, 100 steps, seeded data. The item table "items" (30 x 8, pooling none, features
item_id and history, initial weights uniform(-0.5, 0.5)) is a TorchRec EmbeddingCollection table;
DIN adds "users" (10 x 4, sum pooling, feature user_id, uniform(-0.5, 0.5)) in an
EmbeddingBagCollection. item_id has one id per example; history 0..=7 ids (oldest first, empty
bags included), ids uniform in 0..30. SASRec's target (item_id) is, for half the examples with a
history, the id after the latest history id (mod 30), else uniform, so the model has something to
learn; its labels are all 1 (unused). DIN: 2 dense features ~ randn, user_id uniform in 0..10,
item_id uniform, label = [dense0 + 1.5 * (item_id in history) + 0.2 * (user_id - 4.5) / 4.5 >
0.4 * uniform noise]. The forward passes are written out below in plain
PyTorch on the collections' outputs (SASRec: the latest 5 history ids, learned positions, input
LayerNorm, 2 post-LN blocks of 2-head causal self-attention and a GELU FFN, the user's state at
the latest position, full softmax over the 30 item rows against the item_id target, mean over the
examples with a history; DIN: activation unit over [h, c, h - c, h * c], unnormalised weights,
MLP over [dense, user, c, interest], BCE with logits).

Optimizers. The tables use FBGEMM's fused row-sparse optimizers: each step sums each row's
gradients over all its lookups and updates only the rows looked up in that step, once, fp32 state
(sgd, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM with the table's step count as `t`). Dense
parameters: torch.optim.SGD (sgd case) or torch.optim.Adam with defaults (other cases).

Reference paths:
  * sgd / adagrad / rowwise_adagrad: DistributedModelParallel on CPU (gloo, world size 1,
    table_wise, "fused" compute kernel = FBGEMM's CPU TBE) with the table optimizer attached by
    `_apply_optimizer_in_backward` (torch.optim.SGD, torch.optim.Adagrad,
    torchrec.optim.RowWiseAdagrad). SASRec's full-softmax reads the whole item table through the
    same EmbeddingCollection (an extra feature "catalogue" of the table whose first bag holds
    ids 0..29), so each training step is one fused update with per-row summed gradients.
  * adam: FBGEMM 1.9's CPU TBE rejects ADAM ("not supported in CPU mode"), so the adam fixtures use
    unsharded TorchRec EmbeddingCollection / EmbeddingBagCollection modules and a hand-written
    row-sparse update implementing FBGEMM's ADAM formulas (`RowSparse` below).
The script cross-checks the two paths: for sgd/adagrad/rowwise_adagrad it also trains the
hand-written path and asserts the losses and final tables agree with the fused ones; for SASRec
adam (every row is read every step) it also trains the table with torch.optim.Adam, whose update
then equals FBGEMM's; and after the first step of every run it checks that only looked-up rows
changed.

Regenerate (from the repository root, with the TorchRec anchor venv of ../shared/bench/anchors;
about 15 s on one core):

    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/sequence_trajectory_fixture.py
"""
import copy
import importlib.metadata
import json
import logging
import math
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)  # the planner's and DMP's notes

from torchrec import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.embedding_configs import PoolingType  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "trajectory")
GENERATOR = "scripts/anchors/sequence_trajectory_fixture.py"
BATCH, STEPS = 8, 100
ITEMS, ITEM_DIM, MAX_HISTORY = 30, 8, 7
USERS, USER_DIM, NUM_DENSE_DIN = 10, 4, 2
# TorchRec stores tables in an nn.ModuleDict, where "items" clashes with ModuleDict.items: the
# TorchRec-side names are prefixed (the fixtures use trainrec's names).
T_ITEMS, T_USERS = "t_items", "t_users"
CPU = torch.device("cpu")

SASREC_MODEL = {"kind": "sasrec", "history": "history", "target": "item_id", "max_length": 5, "blocks": 2, "heads": 2,
                "inner_size": 16, "dropout": 0.0, "attention_dropout": 0.0, "layer_norm_eps": 1e-12,
                "loss": "softmax"}
DIN_MODEL = {"kind": "din", "candidate": "item_id", "history": "history", "attention_mlp": [6], "mlp": [8, 1]}

OPTIMIZERS = {
    "sgd": {"sparse": {"kind": "sgd", "lr": 0.05}, "dense": {"kind": "sgd", "lr": 0.05}},
    "adagrad": {"sparse": {"kind": "adagrad", "lr": 0.05, "eps": 1e-8}, "dense": {"kind": "adam", "lr": 0.01}},
    "rowwise_adagrad": {"sparse": {"kind": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8},
                        "dense": {"kind": "adam", "lr": 0.01}},
    "adam": {"sparse": {"kind": "adam", "lr": 0.01, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999},
             "dense": {"kind": "adam", "lr": 0.01}},
}
FUSED_KINDS = ("sgd", "adagrad", "rowwise_adagrad")  # FBGEMM's CPU TBE has no ADAM


# ----------------------------------------------------------------------------------------------
# Dense parts (parameter names are trainrec's)

class Block(nn.Module):
    def __init__(self, d, inner):
        super().__init__()
        self.query, self.key, self.value, self.output = (nn.Linear(d, d) for _ in range(4))
        self.attention_norm = nn.LayerNorm(d, eps=SASREC_MODEL["layer_norm_eps"])
        self.inner, self.outer = nn.Linear(d, inner), nn.Linear(inner, d)
        self.ffn_norm = nn.LayerNorm(d, eps=SASREC_MODEL["layer_norm_eps"])

    def forward(self, x, bias, heads):
        b, l, d = x.shape
        dh = d // heads

        def split(t):
            return t.view(b, l, heads, dh).transpose(1, 2)  # [b, heads, l, dh]

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh) + bias.unsqueeze(1)
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, l, d)
        x = self.attention_norm(self.output(a) + x)
        f = self.outer(F.gelu(self.inner(x)))
        return self.ffn_norm(f + x)


class SasRecDense(nn.Module):
    def __init__(self):
        super().__init__()
        m = SASREC_MODEL
        self.positions = nn.Parameter(torch.zeros(m["max_length"], ITEM_DIM))
        self.input_norm = nn.LayerNorm(ITEM_DIM, eps=m["layer_norm_eps"])
        self.blocks = nn.ModuleList(Block(ITEM_DIM, m["inner_size"]) for _ in range(m["blocks"]))

    def init(self, gen):
        """normal(0, 0.02) Linear weights and positions, then LayerNorm weights/biases and Linear
        biases perturbed by 0.1 * randn from their defaults (1, 0, 0)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "positions" or (name.endswith(".weight") and "norm" not in name):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                elif "norm" in name and name.endswith(".weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))

    def loss(self, history, lengths, catalogue, targets):
        """history: [N, d] rows of the history feature (bags in example order, oldest first);
        lengths: python ints; catalogue: [ITEMS, d] (row r = item r); targets: [B] ids."""
        max_length = SASREC_MODEL["max_length"]
        kept = [min(n, max_length) for n in lengths]
        l = max(kept)
        b = len(lengths)
        src, dst, off = [], [], 0
        for e, (n, m) in enumerate(zip(lengths, kept)):
            for p in range(m):
                src.append(off + n - m + p)
                dst.append(e * l + p)
            off += n
        x = torch.zeros(b * l, ITEM_DIM).index_copy(0, torch.tensor(dst, dtype=torch.long),
                                                     history.index_select(0, torch.tensor(src, dtype=torch.long)))
        x = x.view(b, l, ITEM_DIM) + self.positions[:l].unsqueeze(0)
        x = self.input_norm(x)
        i = torch.arange(l).view(1, l, 1)
        j = torch.arange(l).view(1, 1, l)
        m = torch.tensor(kept).view(b, 1, 1)
        allowed = ((j <= i) & (j < m)).float()
        bias = (1.0 - allowed) * -10000.0
        for block in self.blocks:
            x = block(x, bias, SASREC_MODEL["heads"])
        last = torch.tensor([max(k - 1, 0) for k in kept])
        present = torch.tensor([float(k > 0) for k in kept])
        users = x[torch.arange(b), last] * present.unsqueeze(1)
        logits = users @ catalogue.t()
        ce = F.cross_entropy(logits, targets, reduction="none")
        return (ce * present).sum() / present.sum().clamp_min(torch.finfo(torch.float32).tiny)


class Mlp2(nn.Module):
    def __init__(self, i, h, o):
        super().__init__()
        self.layer0, self.layer1 = nn.Linear(i, h), nn.Linear(h, o)


class DinDense(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Mlp2(4 * ITEM_DIM, DIN_MODEL["attention_mlp"][0], 1)
        self.mlp = Mlp2(NUM_DENSE_DIN + USER_DIM + 2 * ITEM_DIM, DIN_MODEL["mlp"][0], DIN_MODEL["mlp"][1])

    def init(self, gen):
        pass  # nn.Linear's default init (under the seeded global RNG at construction)

    def loss(self, dense, user, candidate, history, lengths, labels):
        b = len(lengths)
        lmax = max(lengths)
        src, dst, off = [], [], 0
        for e, n in enumerate(lengths):
            for p in range(n):
                src.append(off + p)
                dst.append(e * lmax + p)
            off += n
        h = torch.zeros(b * lmax, ITEM_DIM).index_copy(0, torch.tensor(dst, dtype=torch.long),
                                                       history.index_select(0, torch.tensor(src, dtype=torch.long)))
        h = h.view(b, lmax, ITEM_DIM)
        mask = (torch.arange(lmax).view(1, lmax) < torch.tensor(lengths).view(b, 1)).float()
        c = candidate.unsqueeze(1).expand(b, lmax, ITEM_DIM)
        a = torch.cat([h, c, h - c, h * c], dim=2)
        w = self.attention.layer1(torch.sigmoid(self.attention.layer0(a))).squeeze(-1) * mask
        interest = (w.unsqueeze(-1) * h).sum(1)
        x = torch.cat([dense, user, candidate, interest], dim=1)
        logits = self.mlp.layer1(torch.relu(self.mlp.layer0(x))).view(-1)
        return F.binary_cross_entropy_with_logits(logits, labels)


# ----------------------------------------------------------------------------------------------
# Models: collections + dense part; forward returns the loss

def item_table(features):
    return EmbeddingConfig(name=T_ITEMS, embedding_dim=ITEM_DIM, num_embeddings=ITEMS, feature_names=features)


class SasRecRef(nn.Module):
    KEYS = ["item_id", "history", "catalogue"]  # catalogue: trainrec's whole-table read, bag 0 = ids 0..29

    def __init__(self, device):
        super().__init__()
        self.ec = EmbeddingCollection(tables=[item_table(self.KEYS)], device=device)
        self.dense = SasRecDense()

    def forward(self, items, targets):
        out = self.ec(items)
        hist = out["history"]
        return self.dense.loss(hist.values(), hist.lengths().tolist(), out["catalogue"].values(), targets)

    @staticmethod
    def inputs(b):
        item_len, hist_len = b["lengths"][:BATCH], b["lengths"][BATCH:]
        lengths = item_len + hist_len + [ITEMS] + [0] * (BATCH - 1)
        values = b["values"] + list(range(ITEMS))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=SasRecRef.KEYS, values=torch.tensor(values),
                                                  lengths=torch.tensor(lengths))
        targets = torch.tensor(b["values"][:BATCH])
        return (kjt, targets), {T_ITEMS: sorted(set(values))}


class DinRef(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.ec = EmbeddingCollection(tables=[item_table(["item_id", "history"])], device=device)
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=T_USERS, embedding_dim=USER_DIM, num_embeddings=USERS, feature_names=["user_id"],
            pooling=PoolingType.SUM)], device=device)
        self.dense = DinDense()

    def forward(self, users, items, dense, labels):
        u = self.ebc(users)["user_id"]
        out = self.ec(items)
        hist = out["history"]
        cand = out["item_id"]
        # one id per bag: the bag's mean is its row
        assert cand.lengths().eq(1).all()
        return self.dense.loss(dense, u, cand.values(), hist.values(), hist.lengths().tolist(), labels)

    @staticmethod
    def inputs(b):
        lengths, values = b["lengths"], b["values"]
        nu = sum(lengths[:BATCH])
        users = KeyedJaggedTensor.from_lengths_sync(keys=["user_id"], values=torch.tensor(values[:nu]),
                                                    lengths=torch.tensor(lengths[:BATCH]))
        items = KeyedJaggedTensor.from_lengths_sync(keys=["item_id", "history"], values=torch.tensor(values[nu:]),
                                                    lengths=torch.tensor(lengths[BATCH:]))
        dense = torch.tensor(b["dense"]).view(BATCH, NUM_DENSE_DIN)
        return (users, items, dense, torch.tensor(b["labels"])), {T_ITEMS: sorted(set(values[nu:])),
                                                                   T_USERS: sorted(set(values[:nu]))}


# ----------------------------------------------------------------------------------------------
# Data

def sasrec_batches(gen):
    out = []
    for _ in range(STEPS):
        hist_len = torch.randint(0, MAX_HISTORY + 1, (BATCH,), generator=gen)
        hist = torch.randint(0, ITEMS, (int(hist_len.sum()),), generator=gen)
        # A learnable target: half the time the item after the latest history id.
        target = torch.randint(0, ITEMS, (BATCH,), generator=gen)
        coin = torch.rand(BATCH, generator=gen)
        ends = torch.cumsum(hist_len, 0)
        for e in range(BATCH):
            if hist_len[e] > 0 and coin[e] < 0.5:
                target[e] = (hist[ends[e] - 1] + 1) % ITEMS
        assert hist_len.sum() > 0
        out.append({"dense": [], "lengths": [1] * BATCH + hist_len.tolist(),
                    "values": target.tolist() + hist.tolist(), "labels": [1.0] * BATCH})
    return out


def din_batches(gen):
    out = []
    for _ in range(STEPS):
        dense = torch.randn(BATCH, NUM_DENSE_DIN, generator=gen)
        users = torch.randint(0, USERS, (BATCH,), generator=gen)
        cand = torch.randint(0, ITEMS, (BATCH,), generator=gen)
        hist_len = torch.randint(0, MAX_HISTORY + 1, (BATCH,), generator=gen)
        hist = torch.randint(0, ITEMS, (int(hist_len.sum()),), generator=gen)
        noise = torch.rand(BATCH, generator=gen)
        ends = torch.cumsum(hist_len, 0)
        seen = torch.tensor([float(int(cand[e]) in hist[ends[e] - hist_len[e]:ends[e]].tolist())
                             for e in range(BATCH)])
        # A label the model can learn: the first dense feature, and whether the candidate is in the history.
        label = ((dense[:, 0] + 1.5 * seen + 0.2 * (users.float() - 4.5) / 4.5) > 0.4 * noise).float()
        out.append({"dense": dense.reshape(-1).tolist(), "lengths": [1] * BATCH + [1] * BATCH + hist_len.tolist(),
                    "values": users.tolist() + cand.tolist() + hist.tolist(), "labels": label.tolist()})
    return out


# ----------------------------------------------------------------------------------------------
# Training

class RowSparse:
    """FBGEMM's row-sparse table optimizers, written out: the rows looked up in a step get one
    update from their summed gradient (the dense gradient of the nn.Embedding weight); fp32 state;
    `t` counts the table's steps (1 at the first)."""

    def __init__(self, weight, cfg):
        self.w, self.cfg, self.t = weight, cfg, 0
        kind = cfg["kind"]
        if kind == "adagrad":
            self.s = torch.zeros_like(weight)
        elif kind == "rowwise_adagrad":
            self.s = torch.zeros(weight.shape[0])
        elif kind == "adam":
            self.m, self.v = torch.zeros_like(weight), torch.zeros_like(weight)

    @torch.no_grad()
    def step(self, rows):
        c, kind = self.cfg, self.cfg["kind"]
        self.t += 1
        rows = torch.tensor(rows, dtype=torch.long)
        g = self.w.grad.index_select(0, rows) if self.w.grad is not None else torch.zeros(len(rows), self.w.shape[1])
        w = self.w.data
        if kind == "sgd":
            w[rows] = w[rows] - c["lr"] * g
        elif kind == "adagrad":
            self.s[rows] = self.s[rows] + g * g
            w[rows] = w[rows] - c["lr"] * g / (self.s[rows].sqrt() + c["eps"])
        elif kind == "rowwise_adagrad":
            self.s[rows] = self.s[rows] + (g * g).mean(1)
            w[rows] = w[rows] - c["lr"] * g / (self.s[rows].sqrt() + c["eps"]).unsqueeze(1)
        elif kind == "adam":
            b1, b2 = c["beta1"], c["beta2"]
            self.m[rows] = b1 * self.m[rows] + (1 - b1) * g
            self.v[rows] = b2 * self.v[rows] + (1 - b2) * g * g
            m_hat = self.m[rows] / (1 - b1 ** self.t)
            v_hat = self.v[rows] / (1 - b2 ** self.t)
            w[rows] = w[rows] - c["lr"] * m_hat / (v_hat.sqrt() + c["eps"])
        else:
            raise ValueError(kind)
        self.w.grad = None


def dense_optimizer(cfg, params):
    if cfg["kind"] == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"])
    return torch.optim.Adam(params, lr=cfg["lr"])


def fused_class(cfg):
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    kind = cfg["kind"]
    if kind == "sgd":
        return torch.optim.SGD, {"lr": cfg["lr"]}
    if kind == "adagrad":
        return torch.optim.Adagrad, {"lr": cfg["lr"], "eps": cfg["eps"]}
    if kind == "rowwise_adagrad":
        return RowWiseAdagrad, {"lr": cfg["lr"], "eps": cfg["eps"]}
    raise ValueError(f"{kind}: no fused CPU path")


def init_gloo():
    if dist.is_initialized():
        return dist.group.WORLD
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    return dist.group.WORLD


def table_tensors_plain(model):
    out = {T_ITEMS: model.ec.embeddings[T_ITEMS].weight}
    if hasattr(model, "ebc"):
        out[T_USERS] = model.ebc.embedding_bags[T_USERS].weight
    return out


def table_tensors_dmp(dmp):
    out = {}
    for key, t in dmp.state_dict().items():
        for name in (T_ITEMS, T_USERS):
            if key.endswith(f".{name}.weight"):
                shards = t.local_shards()
                assert len(shards) == 1 and list(shards[0].tensor.shape) == list(t.size())
                out[name] = shards[0].tensor
    return out


TBES = []  # (optimizer, pooling, eps, lr) of the FBGEMM TBEs behind the last fused model


def build(cls, mode, opt, tables0, dense0):
    """A model with the initial tables/dense parameters and its step function.
    mode: "fused" (DMP + fused TBE optimizer), "hand" (unsharded, RowSparse) or
    "torch_adam_table" (unsharded, torch.optim.Adam over the item table: a check only)."""
    if mode == "fused":
        from torch.distributed.optim import _apply_optimizer_in_backward
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        pg = init_gloo()
        model = cls(torch.device("meta"))
        model.dense.load_state_dict(dense0)
        klass, kwargs = fused_class(opt["sparse"])
        sparse = list(model.ec.parameters()) + (list(model.ebc.parameters()) if hasattr(model, "ebc") else [])
        _apply_optimizer_in_backward(klass, sparse, kwargs)
        sharders = [EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()]
        cons = {n: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for n in tables0}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), batch_size=BATCH,
                                           constraints=cons)
        plan = planner.collective_plan(model, sharders, pg)
        for _, mp in plan.plan.items():
            for name, s in mp.items():
                assert (s.sharding_type, s.compute_kernel) == ("table_wise", "fused"), (name, s)
        dmp = DistributedModelParallel(module=model, device=CPU, env=ShardingEnv.from_process_group(pg), plan=plan,
                                       sharders=sharders)
        tabs = table_tensors_dmp(dmp)
        assert sorted(tabs) == sorted(tables0)
        with torch.no_grad():
            for n, t in tabs.items():
                t.copy_(tables0[n])
        dense_params = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        assert len(dense_params) == len(dense0)
        dopt = dense_optimizer(opt["dense"], dense_params)

        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        # The sharded collections keep their lookups (and the FBGEMM TBE inside) in a plain list.
        tbes = [k.emb_module for m in dmp.modules() for lookup in getattr(m, "_lookups", []) for k in lookup.modules()
                if isinstance(getattr(k, "emb_module", None), SplitTableBatchedEmbeddingBagsCodegen)]
        assert len(tbes) == len(tables0) and all(m.use_cpu for m in tbes), [(type(m), m.use_cpu) for m in tbes]
        TBES[:] = [(m.optimizer.name, m.pooling_mode.name, m.optimizer_args.eps, m.get_learning_rate())
                   for m in tbes]

        def step(args, touched):
            loss = dmp(*args)
            dopt.zero_grad()
            loss.backward()  # the tables' fused update runs inside the backward
            dopt.step()
            return loss.item()

        return step, lambda: table_tensors_dmp(dmp)

    model = cls(CPU)
    model.dense.load_state_dict(dense0)
    tabs = table_tensors_plain(model)
    with torch.no_grad():
        for n, t in tabs.items():
            t.copy_(tables0[n])
    dopt = dense_optimizer(opt["dense"], list(model.dense.parameters()))
    if mode == "torch_adam_table":
        c = opt["sparse"]
        topt = torch.optim.Adam([tabs[T_ITEMS]], lr=c["lr"], betas=(c["beta1"], c["beta2"]), eps=c["eps"])
        sparse = None
    else:
        sparse = {n: RowSparse(t, opt["sparse"]) for n, t in tabs.items()}

    def step(args, touched):
        loss = model(*args)
        dopt.zero_grad()
        for t in tabs.values():
            t.grad = None
        loss.backward()
        dopt.step()
        if sparse is None:
            assert touched[T_ITEMS] == list(range(ITEMS))
            topt.step()
        else:
            for n, s in sparse.items():
                s.step(touched[n])
        return loss.item()

    return step, lambda: table_tensors_plain(model)


def train(cls, mode, opt, tables0, dense0, data):
    step, tables = build(cls, mode, opt, tables0, dense0)
    losses = []
    for i, b in enumerate(data):
        args, touched = cls.inputs(b)
        before = {n: t.detach().clone() for n, t in tables().items()} if i == 0 else None
        losses.append(step(args, touched))
        if i == 0:
            # Only the rows looked up in the step may change (and some must).
            for n, t in tables().items():
                changed = (t.detach() != before[n]).any(1).nonzero().view(-1).tolist()
                assert changed and set(changed) <= set(touched[n]), (mode, n, changed, touched[n])
                if len(touched[n]) < t.shape[0]:
                    assert len(changed) < t.shape[0]
    final = {n: t.detach().clone() for n, t in tables().items()}
    return losses, final


def rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------

def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    versions = {"torchrec": importlib.metadata.version("torchrec"), "torch": torch.__version__,
                "fbgemm": importlib.metadata.version("fbgemm-gpu-cpu")}
    for name, cls, dense_cls, model_cfg, keys, num_dense, make_data, seed in (
            ("sasrec", SasRecRef, SasRecDense, SASREC_MODEL, ["item_id", "history"], 0, sasrec_batches, 11),
            ("din", DinRef, DinDense, DIN_MODEL, ["user_id", "item_id", "history"], NUM_DENSE_DIN, din_batches, 12)):
        torch.manual_seed(2026 + seed)
        gen = torch.Generator().manual_seed(seed)
        dense = dense_cls()
        dense.init(gen)
        dense0 = copy.deepcopy(dense.state_dict())
        tables0 = {T_ITEMS: torch.rand(ITEMS, ITEM_DIM, generator=gen) - 0.5}
        tables = [{"name": "items", "features": ["item_id", "history"], "rows": ITEMS, "dim": ITEM_DIM,
                   "pooling": "none"}]
        if name == "din":
            tables0[T_USERS] = torch.rand(USERS, USER_DIM, generator=gen) - 0.5
            tables.insert(0, {"name": "users", "features": ["user_id"], "rows": USERS, "dim": USER_DIM,
                              "pooling": "sum"})
        data = make_data(torch.Generator().manual_seed(100 + seed))
        ours = {T_ITEMS: "items", T_USERS: "users"}
        for opt_name, opt in OPTIMIZERS.items():
            if opt_name in FUSED_KINDS:
                losses, final = train(cls, "fused", opt, tables0, dense0, data)
                hand, hand_final = train(cls, "hand", opt, tables0, dense0, data)
                check = ("hand-written", hand, hand_final)
                tbe = ", ".join(f"{o}/{p}" for o, p, _, _ in TBES)
                assert all(abs(lr - opt["sparse"]["lr"]) < 1e-9 and (opt_name == "sgd" or eps == opt["sparse"]["eps"])
                           for _, _, eps, lr in TBES), TBES
                reference = ("DMP fused EC" + ("+EBC" if name == "din" else "") +
                             f" (gloo world 1, table_wise, FBGEMM CPU TBE {tbe})")
            else:
                losses, final = train(cls, "hand", opt, tables0, dense0, data)
                check = None
                if name == "sasrec":
                    ta, ta_final = train(cls, "torch_adam_table", opt, tables0, dense0, data)
                    check = ("torch.optim.Adam on the table", ta, ta_final)
                reference = ("unsharded TorchRec EC" + ("+EBC" if name == "din" else "") +
                             ", hand-written FBGEMM ADAM row-sparse update (FBGEMM CPU TBE has no ADAM)")
            note = ""
            if check is not None:
                what, other, other_final = check
                r = rel(other, losses)
                dt = max((other_final[n] - final[n]).abs().max().item() for n in final)
                assert r < 1e-5 and dt < 1e-5, (name, opt_name, what, r, dt)
                note = f"  [{what}: max rel loss diff {r:.1e}, max table diff {dt:.1e}]"
            assert all(math.isfinite(x) for x in losses)
            doc = {"generator": GENERATOR, **versions, "reference": reference, "model": model_cfg,
                   "optimizer": opt, "tables": tables, "keys": keys, "num_dense": num_dense, "batch": BATCH,
                   "table_weights": {ours[n]: t.reshape(-1).tolist() for n, t in tables0.items()},
                   "params": {n: {"shape": list(p.shape), "values": p.reshape(-1).tolist()} for n, p in dense0.items()},
                   "batches": data, "losses": losses}
            path = os.path.join(OUT, f"{name}_{opt_name}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f, separators=(",", ":"))
            os.replace(path + ".tmp", path)
            print(f"{name}_{opt_name}: {losses[0]:.6f} -> {losses[-1]:.6f} ({reference}){note}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
