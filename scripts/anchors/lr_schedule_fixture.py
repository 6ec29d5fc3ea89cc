#!/usr/bin/env python3
"""Per-step learning rates of TorchRec's WarmupOptimizer, the fixture of trainrec's LR schedules
(`framework/types/tests/fixtures/lr_schedules.json`).

Run with the anchors' venv (../shared/bench/anchors/install.sh):
    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/lr_schedule_fixture.py > framework/types/tests/fixtures/lr_schedules.json

Each case wraps a plain SGD KeyedOptimizer in `torchrec.optim.warmup.WarmupOptimizer` with the
case's stages and base lr, and records the lr of its param group before each of `steps` steps
(the lr that step applies).
"""
import json

import torch
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

P = WarmupPolicy
CASES = [
    ("linear_then_poly", 0.05, 60, [
        WarmupStage(policy=P.LINEAR, max_iters=10, value=0.1),
        WarmupStage(policy=P.POLY, max_iters=50, value=2.0),
    ]),
    ("constant_then_step", 0.1, 40, [
        WarmupStage(policy=P.CONSTANT, max_iters=5, value=0.5),
        WarmupStage(policy=P.STEP, max_iters=30, value=0.5, decay_iters=7),
    ]),
    ("linear_then_invsqrt_scaled", 1.0, 30, [
        WarmupStage(policy=P.LINEAR, max_iters=4, value=0.0),
        WarmupStage(policy=P.INVSQRT, max_iters=20, lr_scale=0.5),
    ]),
    ("cosine_warm_restarts", 0.2, 40, [
        WarmupStage(policy=P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=35, value=0.1, sgdr_period=8, lr_scale=2.0),
    ]),
    ("mlperf_dlrm_dcnv2", 0.0034, 120, [
        WarmupStage(policy=P.LINEAR, max_iters=20, value=0.0),
        WarmupStage(policy=P.CONSTANT, max_iters=60, value=1.0),
        WarmupStage(policy=P.POLY, max_iters=100, value=2.0, decay_iters=100),
    ]),
]


def stage_json(s):
    out = {"policy": s.policy.value, "max_iters": s.max_iters, "value": s.value, "lr_scale": s.lr_scale}
    if s.decay_iters > 0:
        out["decay_iters"] = s.decay_iters
    if s.sgdr_period != 1:
        out["sgdr_period"] = s.sgdr_period
    return out


def main():
    cases = []
    for name, lr, steps, stages in CASES:
        given = [stage_json(s) for s in stages]  # before _lr_stages fills in defaults
        p = torch.nn.Parameter(torch.zeros(1))
        opt = WarmupOptimizer(KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=lr)), stages, lr=lr)
        lrs = []
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            p.grad = torch.zeros(1)
            opt.step()
        cases.append({"name": name, "lr": lr, "stages": given, "lrs": lrs})
    print(json.dumps({"torchrec": __import__("torchrec").__version__, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
