"""Independent SASRec reference: RecBole 1.2.1's SASRec on MovieLens-100K, leave-one-out, full ranking.

Setup (once; idempotent):
    bash scripts/anchors/recbole_install.sh
      -> ~/.cache/trainrec-anchors/recbole-venv, which reuses torch 2.14.1 + numpy 2 from the
         TorchRec anchors venv (../shared/bench/anchors/install.sh) through a .pth file.

Regenerate (the numbers printed are the reference; nothing is written unless --dump-split):
    ~/.cache/trainrec-anchors/recbole-venv/bin/python scripts/anchors/recbole_sasrec.py \
        --epochs 200 --seeds 1 2 3 --threads 1 > scripts/anchors/results/recbole_sasrec-DATE.jsonl
    Smoke run: --epochs 1 --seeds 1 (one epoch = 48 batches of 2048 took 193 s on 1 CPU thread
    of the 2-core dev machine while it was also compiling, so 200 epochs is hours per seed on
    CPU; --device cuda makes RecBole use the GPU, untested here).

Protocol (only RecBole's own API is called: recbole.config.Config, recbole.data.create_dataset /
data_preparation, recbole.model.sequential_recommender.SASRec, recbole.trainer.Trainer):
  - Data: the ml-100k atomic files that ship inside the recbole wheel
    (recbole/dataset_example/ml-100k; 100,000 interactions, 943 users, 1,682 items). RecBole's
    ml-100k defaults apply no filtering, no de-duplication and no rating threshold, so every
    interaction is a positive. User and item tokens are remapped to 1..N in order of first
    appearance in ml-100k.inter; id 0 is padding.
  - Order 'TO'. RecBole min-max normalises the timestamp and stores it as float32 before sorting
    (stable sort, ties kept in file order), so timestamps less than ~1 s apart can tie; with
    same-second ties (common in ml-100k) the row order of ml-100k.inter decides.
  - Each interaction but a user's first becomes an example "previous <= --max-len items -> this
    item" (RecBole's SequentialDataset augmentation, done before the split).
  - eval_args split {'LS': 'test_only'}: per user the last example (target = last item, history =
    the --max-len items before it) is the test set; all the user's other examples are training.
    No validation set, no early stopping: exactly --epochs epochs of Trainer.fit, then one
    evaluation of the test split.
  - mode 'full': every item is ranked (only padding id 0 is excluded; the user's history items
    are NOT masked), metrics Hit@10 and NDCG@10 (one positive per user).
  - SASRec with loss_type 'CE' (softmax over all item ids), Adam, no weight decay.

Output: one JSON line per seed
    {"seed", "epochs", "hit@10", "ndcg@10", "train_seconds", "seconds_per_epoch", "final_loss", ...}
then one summary line with means and sample standard deviations over the seeds.

Compatibility handled here (RecBole 1.2.1 predates numpy 2 and torch 2.14):
  - recbole.config.Config.__init__ calls compatibility_settings(), which reads np.float_,
    np.complex_ and np.unicode_, all removed in numpy 2: they are re-added as aliases of
    np.float64 / np.complex128 / np.str_ before the first Config is built.
  - recbole.quick_start imports ray <= 2.6.3, which breaks on numpy 2; it is never imported
    (and recbole_install.sh does not install ray).
  - Config reads `--key=value` words from sys.argv as RecBole parameters; sys.argv is cut to
    the script name before Config is built so this script's own flags cannot leak in.
  - Trainer writes ./log_tensorboard and a checkpoint dir: both go to a temporary working dir.
  - Importing recbole.model.sequential_recommender runs sine.py's module-level
    torch.autograd.set_detect_anomaly(True); it is switched off again before training (it adds
    NaN checks on every backward output, not different math); --anomaly-mode keeps it.
  - No torch.load is reached (fit(saved=False), evaluate(load_best_model=False)).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings


def _numpy2_aliases():
    import numpy as np

    for old, new in (("float_", "float64"), ("complex_", "complex128"), ("unicode_", "str_")):
        if not hasattr(np, old):
            setattr(np, old, getattr(np, new))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[2020])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=2)
    p.add_argument("--inner-size", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.5, help="hidden_dropout_prob and attn_dropout_prob")
    p.add_argument("--max-len", type=int, default=50, help="MAX_ITEM_LIST_LENGTH")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--anomaly-mode", action="store_true",
                   help="keep the autograd anomaly mode that importing RecBole's models switches on "
                        "(same results, slower)")
    p.add_argument("--dump-split", metavar="PATH",
                   help="write RecBole's test examples (original ml-100k tokens) as JSON lines: "
                        "{user, history (oldest first), target}")
    return p.parse_args()


def build_config(args, seed, workdir):
    from recbole.config import Config

    config_dict = {
        # environment
        "gpu_id": "0" if args.device == "cuda" else "",
        "use_gpu": args.device == "cuda",
        "seed": seed,
        "reproducibility": True,
        "worker": 0,
        "show_progress": False,
        "checkpoint_dir": os.path.join(workdir, "saved"),
        "save_dataset": False,
        "save_dataloaders": False,
        "state": "WARNING",
        # data (ml-100k defaults restated: no filtering, no label threshold)
        "load_col": {"inter": ["user_id", "item_id", "rating", "timestamp"]},
        "threshold": None,
        "val_interval": None,
        "rm_dup_inter": None,
        "user_inter_num_interval": None,
        "item_inter_num_interval": None,
        "MAX_ITEM_LIST_LENGTH": args.max_len,
        # evaluation
        "eval_args": {"split": {"LS": "test_only"}, "group_by": "user", "order": "TO", "mode": "full"},
        "repeatable": True,
        "metrics": ["Hit", "NDCG"],
        "topk": [10],
        "valid_metric": "NDCG@10",
        "metric_decimal_place": 6,
        "eval_batch_size": 4096,
        # training
        "epochs": args.epochs,
        "train_batch_size": args.batch_size,
        "learner": "adam",
        "learning_rate": args.lr,
        "weight_decay": 0.0,
        "train_neg_sample_args": None,
        "shuffle": True,
        # model
        "loss_type": "CE",
        "hidden_size": args.hidden_size,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "inner_size": args.inner_size,
        "hidden_dropout_prob": args.dropout,
        "attn_dropout_prob": args.dropout,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
        "initializer_range": 0.02,
    }
    return Config(model="SASRec", dataset="ml-100k", config_dict=config_dict)


def dump_split(path, test_dataset):
    inter = test_dataset.inter_feat
    uid, iid = test_dataset.uid_field, test_dataset.iid_field
    seq_field = iid + test_dataset.config["LIST_SUFFIX"]
    len_field = test_dataset.config["ITEM_LIST_LENGTH_FIELD"]
    users = test_dataset.id2token(uid, inter[uid].numpy())
    targets = test_dataset.id2token(iid, inter[iid].numpy())
    seqs, lens = inter[seq_field].numpy(), inter[len_field].numpy()
    with open(path, "w") as f:
        for u, t, s, n in zip(users, targets, seqs, lens):
            hist = test_dataset.id2token(iid, s[:n]).tolist()
            f.write(json.dumps({"user": str(u), "history": [str(h) for h in hist], "target": str(t)}) + "\n")


def run_seed(args, seed, workdir):
    import torch
    from recbole.data import create_dataset, data_preparation
    from recbole.model.sequential_recommender import SASRec
    from recbole.trainer import Trainer
    from recbole.utils import init_seed

    config = build_config(args, seed, workdir)
    init_seed(config["seed"], config["reproducibility"])
    t0 = time.perf_counter()
    dataset = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    data_seconds = time.perf_counter() - t0
    if args.dump_split:
        dump_split(args.dump_split, test_data._dataset)

    # as recbole.quick_start.run_recbole does: reseed after the data, before the model
    init_seed(config["seed"], config["reproducibility"])
    model = SASRec(config, train_data._dataset).to(config["device"])
    trainer = Trainer(config, model)
    # recbole/model/sequential_recommender/sine.py calls torch.autograd.set_detect_anomaly(True)
    # at import time (the package __init__ imports it, so every RecBole sequential model runs in
    # anomaly mode). It only adds NaN checks/trace recording (~25-40% of a CPU step), not math.
    if not args.anomaly_mode:
        torch.autograd.set_detect_anomaly(False)
    anomaly = torch.is_anomaly_enabled()

    t0 = time.perf_counter()
    trainer.fit(train_data, valid_data=None, verbose=False, saved=False, show_progress=False)
    train_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = trainer.evaluate(test_data, load_best_model=False, show_progress=False)
    eval_seconds = time.perf_counter() - t0

    losses = [trainer.train_loss_dict[e] for e in sorted(trainer.train_loss_dict)]
    return {
        "seed": seed,
        "epochs": args.epochs,
        "hit@10": float(result["hit@10"]),
        "ndcg@10": float(result["ndcg@10"]),
        "train_seconds": round(train_seconds, 3),
        "seconds_per_epoch": round(train_seconds / max(args.epochs, 1), 3),
        "final_loss": losses[-1] / len(train_data) if losses else None,  # mean batch loss, last epoch
        "eval_seconds": round(eval_seconds, 3),
        "data_seconds": round(data_seconds, 3),
        "n_users": int(dataset.user_num - 1),
        "n_items": int(dataset.item_num - 1),
        "n_train_examples": len(train_data._dataset),
        "n_test_examples": len(test_data._dataset),
        "threads": torch.get_num_threads(),
        "anomaly_mode": anomaly,
        "device": str(config["device"]),
    }


def main():
    args = parse_args()
    sys.argv = sys.argv[:1]  # RecBole's Config parses --key=value from sys.argv
    if args.dump_split:
        args.dump_split = os.path.abspath(args.dump_split)
    _numpy2_aliases()
    # pandas 2.3 (chained fillna) and torch (torch.cuda.amp.GradScaler) deprecation notices
    # raised inside RecBole; they do not change results.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"recbole\.")

    import torch

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(args.threads)
    except RuntimeError:
        pass

    import recbole

    rows = []
    with tempfile.TemporaryDirectory(prefix="recbole-sasrec-") as workdir:
        cwd = os.getcwd()
        os.chdir(workdir)  # Trainer writes ./log_tensorboard
        try:
            for seed in args.seeds:
                row = run_seed(args, seed, workdir)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            os.chdir(cwd)

    def mean_std(key):
        vals = [r[key] for r in rows]
        return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)

    summary = {"summary": True, "recbole": recbole.__version__, "torch": torch.__version__,
               "seeds": [r["seed"] for r in rows], "epochs": args.epochs,
               "config": {k: getattr(args, k) for k in ("hidden_size", "n_layers", "n_heads", "inner_size",
                                                        "dropout", "max_len", "batch_size", "lr", "threads")}}
    for key in ("hit@10", "ndcg@10", "train_seconds", "seconds_per_epoch"):
        m, s = mean_std(key)
        summary[key + "_mean"] = m
        summary[key + "_std"] = s
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
