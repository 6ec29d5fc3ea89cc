#!/usr/bin/env python3
"""Dense gradient clipping as TorchRec's `GradientClippingOptimizer` does it on replicated
(dense) parameters (`torch.nn.utils.clip_grad_norm_` / `clip_grad_value_`): the fixture of
trainrec's `optimizer.dense_clipping` (`framework/models/tests/fixtures/grad_clipping.json`).

Run with the anchors' venv (../shared/bench/anchors/install.sh):
    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/grad_clipping_fixture.py > framework/models/tests/fixtures/grad_clipping.json

Each case: three gradient tensors (float32, seeded normal values scaled so that some cases clip
and some do not), the clipping, and the gradients after it (with the total norm TorchRec
reports for norm clipping).
"""
import json

import torch
from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
from torchrec.optim.keyed import KeyedOptimizerWrapper

CASES = [
    ("norm_2_clips", "norm", 1.0, 2.0, 3.0),
    ("norm_2_no_clip", "norm", 100.0, 2.0, 0.5),
    ("norm_1", "norm", 2.5, 1.0, 1.0),
    ("norm_inf", "norm", 0.3, float("inf"), 1.0),
    ("value", "value", 0.25, 2.0, 1.0),
]
SHAPES = [(4, 3), (3,), (2, 5)]


def main():
    out = []
    for i, (name, kind, max_gradient, norm_type, scale) in enumerate(CASES):
        gen = torch.Generator().manual_seed(100 + i)
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * scale
        before = [p.grad.clone() for p in params]
        opt = GradientClippingOptimizer(
            KeyedOptimizerWrapper({f"p{j}": p for j, p in enumerate(params)}, lambda ps: torch.optim.SGD(ps, lr=0.0)),
            clipping=GradientClipping.NORM if kind == "norm" else GradientClipping.VALUE,
            max_gradient=max_gradient,
            norm_type=norm_type,
        )
        opt.step()
        total = opt._last_total_grad_norm
        out.append({
            "name": name,
            "kind": kind,
            "max_gradient": max_gradient,
            "norm_type": "inf" if norm_type == float("inf") else norm_type,
            "shapes": [list(s) for s in SHAPES],
            "grads": [g.flatten().tolist() for g in before],
            "clipped": [p.grad.flatten().tolist() for p in params],
            "total_norm": None if total is None else float(total),
        })
    print(json.dumps({"torchrec": __import__("torchrec").__version__, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
