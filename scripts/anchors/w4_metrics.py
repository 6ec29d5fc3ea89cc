"""trainrec's copy of ../shared/bench/anchors/w4_metrics.py with one flag added, `--dump PATH`:
writes the generated predictions then labels as raw little-endian float32 to PATH (before any
timing), the input of `trainrec bench metrics --data PATH`, so both sides time and report
values on the very same samples. Without `--dump` it is the original script. The timing
helpers are the shared common.py (TRAINREC_ANCHORS_DIR overrides where it is).

    ~/.cache/trainrec-anchors/venv/bin/python scripts/anchors/w4_metrics.py --dump /tmp/w4.f32

W4 "metrics": cost of torchrec.metrics NE and AUC (world_size 1, CPU, one task).

Per repeat: a fresh metric, update() with --n predictions in batches of --batch (last batch
partial), then compute(). Predictions are sigmoid(N(0,1)) logits, labels Bernoulli(pred)
(so the model is calibrated and AUC ~ 0.7), weights 1. Pre-generated. AUC window is
--window samples (default 2^20 >= n, so AUC covers all predictions); NE window likewise.
Reports per-metric update-total, per-update and compute times over --repeats.
Prints one JSON line.
"""

import argparse
import os
import time

import shared_anchors  # noqa: F401 (puts the shared common.py on sys.path)
from common import emit, env_info, set_threads, summarize  # noqa: E402

import torch  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--window", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--metrics", default="ne,auc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--dump", default=None, help="write predictions then labels (raw <f4) here")
    return p.parse_args()


def main():
    a = parse()
    set_threads(a.threads)
    info = env_info()
    from torchrec.metrics.auc import AUCMetric
    from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
    from torchrec.metrics.ne import NEMetric

    g = torch.Generator().manual_seed(a.seed)
    pred = torch.sigmoid(torch.randn(a.n, generator=g))
    label = torch.bernoulli(pred, generator=g)
    weight = torch.ones(a.n)
    if a.dump:
        tmp = a.dump + ".tmp"
        with open(tmp, "wb") as f:
            f.write(pred.numpy().astype("<f4").tobytes())
            f.write(label.numpy().astype("<f4").tobytes())
        os.replace(tmp, a.dump)
    task = RecTaskInfo(name="t")
    chunks = [(pred[i:i + a.batch], label[i:i + a.batch], weight[i:i + a.batch]) for i in range(0, a.n, a.batch)]
    classes = {"ne": NEMetric, "auc": AUCMetric}
    out = {"workload": "w4_metrics", "config": vars(a), "num_updates": len(chunks)}
    for name in a.metrics.split(","):
        upd, comp, val = [], [], None
        for _ in range(a.repeats):
            m = classes[name](world_size=1, my_rank=0, batch_size=a.batch, tasks=[task],
                              compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION, window_size=a.window)
            t0 = time.perf_counter()
            for p_, l_, w_ in chunks:
                m.update(predictions={"t": p_}, labels={"t": l_}, weights={"t": w_})
            t1 = time.perf_counter()
            r = m.compute()
            t2 = time.perf_counter()
            upd.append(t1 - t0)
            comp.append(t2 - t1)
            val = {k: float(v) for k, v in r.items()}
        out[name] = {"update_total": summarize(upd), "update_per_call_us_median": summarize(upd)["median_s"] / len(chunks) * 1e6,
                     "compute": summarize(comp), "values": val}
    # reference values (NumPy) to cross-check the metric semantics
    import numpy as np

    p, y = pred.double().numpy(), label.double().numpy()
    ce = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    ctr = y.mean()
    order = np.argsort(p, kind="mergesort")
    ranks = np.empty(a.n)
    ranks[order] = np.arange(1, a.n + 1)
    n1 = y.sum()
    out["reference"] = {"ne": float(ce / -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))),
                        "auc": float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * (a.n - n1)))}
    emit(out, info)


if __name__ == "__main__":
    main()
