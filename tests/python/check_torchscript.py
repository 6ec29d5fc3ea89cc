"""Checks a `trainrec export --format torchscript` file with plain PyTorch (no trainrec code)
against `trainrec predict` on the run it came from.

    trainrec export RUN_DIR --format torchscript --out /tmp/model.pt
    python tests/python/check_torchscript.py RUN_DIR /tmp/model.pt --trainrec target/release/trainrec
    trainrec export RUN_DIR --format torchscript --quantize int8 --out /tmp/model_int8.pt
    python tests/python/check_torchscript.py RUN_DIR /tmp/model_int8.pt --trainrec target/release/trainrec --quantized

Runs `BIN predict RUN_DIR --out TMP/p.jsonl --with-inputs [--set KEY=VALUE ...]`, loads MODEL.pt
with torch.jit.load, feeds the rows' `dense` and `ids_<feature>` (in the file's `feature_names`
order) through `logits`, `forward` and `forward_kjt` in batches of --batch rows, and compares
with the `logit_<task>` / `<task>` columns (tasks in the file's `task_names` order). AUCs (ties
as average ranks) of trainrec's and the file's probabilities against `label_<task>`, when the
data has labels. Prints one JSON line.

Exit 0 when max_abs_diff (logits) <= --tol (1e-5) and forward / forward_kjt agree with logits
to --tol; with --auc-tol X instead when, for every task, the two AUCs differ by at most X (an
int8 file against its fp32 run). --quantized: the file must say it is quantized (extra/trainrec.json
"quantize" not null) and the AUC criterion applies, with --auc-tol 0.002 unless given.
Exit 1 otherwise. No importable PyTorch: prints {"skipped": REASON} and exits 0.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile


def auc(torch, scores, labels):
    """ROC AUC of float scores against 0/1 labels, ties as average ranks; None with one class."""
    s = scores.double()
    pos = labels > 0.5
    p = int(pos.sum())
    n = s.numel() - p
    if p == 0 or n == 0:
        return None
    _, inv, cnt = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    avg_rank = torch.cumsum(cnt, 0).double() - (cnt.double() - 1) / 2  # 1-based
    r = avg_rank[inv]
    return float((r[pos].sum() - p * (p + 1) / 2) / (p * n))


def read_batches(path, batch):
    with open(path) as f:
        rows = []
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if len(rows) == batch:
                    yield rows
                    rows = []
        if rows:
            yield rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("model")
    ap.add_argument("--trainrec", required=True, help="the trainrec binary")
    ap.add_argument("--quantized", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--auc-tol", type=float, default=None)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to trainrec predict")
    a = ap.parse_args()
    out = {"run_dir": a.run_dir, "model": a.model}

    def finish(ok, **kv):
        out.update(kv)
        out["pass"] = ok
        print(json.dumps(out), flush=True)
        return 0 if ok else 1

    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no PyTorch here"
        print(json.dumps({"skipped": f"no PyTorch: {type(e).__name__}: {e}"}), flush=True)
        return 0
    out["torch"] = torch.__version__
    auc_tol = a.auc_tol if a.auc_tol is not None else (0.002 if a.quantized else None)

    extra = {"trainrec.json": ""}
    m = torch.jit.load(a.model, map_location="cpu", _extra_files=extra)
    m.eval()
    try:
        out["trainrec_json"] = json.loads(extra["trainrec.json"]) if extra["trainrec.json"] else None
    except ValueError:
        out["trainrec_json"] = None
    feats, tasks, nd = list(m.feature_names), list(m.task_names), int(m.num_dense)
    has_kjt = hasattr(m, "forward_kjt")

    with tempfile.TemporaryDirectory(prefix="check_torchscript_") as tmp:
        pred = os.path.join(tmp, "p.jsonl")
        cmd = [a.trainrec, "predict", a.run_dir, "--out", pred, "--with-inputs"]
        for s in a.set:
            cmd += ["--set", s]
        out["predict_cmd"] = cmd
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            return finish(False, error=f"trainrec predict exited {r.returncode}", stderr_tail=r.stderr[-2000:])

        n = 0
        d_logit = d_prob = d_kjt = 0.0
        cols = {t: {"tr": [], "ts": [], "label": []} for t in tasks}
        has_labels = True
        with torch.no_grad():
            for rows in read_batches(pred, a.batch):
                try:
                    dense = torch.tensor([row["dense"] for row in rows], dtype=torch.float32).reshape(len(rows), nd)
                    ids = [torch.tensor([i for row in rows for i in row[f"ids_{f}"]], dtype=torch.int64)
                           for f in feats]
                    lengths = [torch.tensor([len(row[f"ids_{f}"]) for row in rows], dtype=torch.int64) for f in feats]
                    want_logit = torch.tensor([[row[f"logit_{t}"] for t in tasks] for row in rows], dtype=torch.float32)
                    want_prob = torch.tensor([[row[t] for t in tasks] for row in rows], dtype=torch.float32)
                except (KeyError, RuntimeError, ValueError, TypeError) as e:
                    return finish(False, error=f"rows {n}..: not in the documented format: {type(e).__name__}: {e}",
                                  first_row_keys=sorted(rows[0].keys()))
                logit = m.logits(dense, ids, lengths).float().reshape(len(rows), len(tasks))
                prob = m(dense, ids, lengths).float().reshape(len(rows), len(tasks))
                d_logit = max(d_logit, float((logit - want_logit).abs().max()))
                d_prob = max(d_prob, float((prob - torch.sigmoid(logit)).abs().max()))
                if has_kjt:
                    kjt = m.forward_kjt(dense, torch.cat(ids), torch.cat(lengths)).float().reshape(len(rows), len(tasks))
                    d_kjt = max(d_kjt, float((kjt - prob).abs().max()))
                has_labels = has_labels and all(f"label_{t}" in rows[0] for t in tasks)
                for j, t in enumerate(tasks):
                    cols[t]["tr"].append(want_prob[:, j])
                    cols[t]["ts"].append(prob[:, j])
                    if has_labels:
                        cols[t]["label"].append(torch.tensor([row[f"label_{t}"] for row in rows], dtype=torch.float32))
                n += len(rows)

    per_task = {}
    for t in tasks:
        tr, ts = torch.cat(cols[t]["tr"]) if n else torch.empty(0), torch.cat(cols[t]["ts"]) if n else torch.empty(0)
        e = {"max_abs_diff_prob": float((tr - ts).abs().max()) if n else None}
        if has_labels and n:
            lab = torch.cat(cols[t]["label"])
            e["auc_trainrec"], e["auc_torchscript"] = auc(torch, tr, lab), auc(torch, ts, lab)
            if e["auc_trainrec"] is not None:
                e["auc_diff"] = e["auc_torchscript"] - e["auc_trainrec"]
        per_task[t] = e
    out.update(rows=n, tasks=per_task, max_abs_diff=d_logit, forward_vs_sigmoid_logits=d_prob,
               forward_kjt_vs_forward=d_kjt if has_kjt else None, feature_names=feats, num_dense=nd)
    if n == 0:
        return finish(False, error="trainrec predict wrote no rows")
    quant = (out["trainrec_json"] or {}).get("quantize")
    problems = []
    if d_prob > a.tol:
        problems.append(f"forward differs from sigmoid(logits) by {d_prob:.3g}")
    if has_kjt and d_kjt > a.tol:
        problems.append(f"forward_kjt differs from forward by {d_kjt:.3g}")
    if a.quantized and not quant:
        problems.append("--quantized, but extra/trainrec.json says quantize is null")
    if auc_tol is None:
        out["criterion"] = f"max_abs_diff <= {a.tol}"
        if not d_logit <= a.tol:
            problems.append(f"max_abs_diff {d_logit:.3g} > {a.tol}")
    else:
        out["criterion"] = f"|auc_torchscript - auc_trainrec| <= {auc_tol} for every task"
        if not has_labels:
            problems.append("--auc-tol, but the rows have no label_<task> columns")
        for t, e in per_task.items():
            d = e.get("auc_diff")
            if d is None or math.isnan(d) or abs(d) > auc_tol:
                problems.append(f"task {t}: AUC difference {d} (tolerance {auc_tol})")
    return finish(not problems, problems=problems)


if __name__ == "__main__":
    sys.exit(main())
