"""Writes sample.svm: 2,000 synthetic LIBSVM lines with a planted linear signal (no real data).

Regenerate: python3 plugins/libsvm-sampler/data/gen_sample.py
"""
import math
import os
import random

rng = random.Random(7)
weights = [rng.gauss(0.0, 1.0) for _ in range(500)]
lines = []
for _ in range(2000):
    idx = sorted(rng.sample(range(500), rng.randint(3, 12)))
    vals = [round(rng.uniform(0.1, 2.0), 3) for _ in idx]
    z = sum(weights[i] * v for i, v in zip(idx, vals)) / 2.0
    label = 1 if rng.random() < 1.0 / (1.0 + math.exp(-z)) else -1
    lines.append(f"{label:+d} " + " ".join(f"{i}:{v}" for i, v in zip(idx, vals)))
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample.svm")
with open(out, "w") as f:
    f.write("# synthetic LIBSVM sample written by gen_sample.py\n")
    f.write("\n".join(lines) + "\n")
