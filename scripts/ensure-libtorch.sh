#!/usr/bin/env bash
# Provisions libtorch (from PyPI's torch wheel) into the git-ignored folder .libtorch/ when it is
# missing. tch 0.24 pins libtorch 2.11.0; the GPU test machine has the same version.
# Idempotent: a complete install is detected by its marker file and left alone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.libtorch"
marker="$dest/.complete-2.11.0"
if [ -f "$marker" ]; then
  exit 0
fi
echo "trainrec: libtorch 2.11.0 not found under .libtorch/, installing it from PyPI (about 1.2 GB, once)..." >&2
tmp="$root/.libtorch.partial"
rm -rf "$tmp"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$tmp" \
  torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
# CPU build: without libtorch_cuda.so torch-sys links the CPU libraries only, so the small CUDA
# runtime wheels above are all libtorch_cpu.so needs. Drop what a CPU build never loads.
rm -f "$tmp"/torch/lib/libtorch_cuda*.so "$tmp"/torch/lib/libc10_cuda.so
rm -rf "$tmp"/torch/bin "$tmp"/torch/_inductor "$tmp"/torch/testing "$tmp"/triton 2>/dev/null || true
# torch-sys checks the version only when this file exists: keep the check honest.
echo "2.11.0" > "$tmp/torch/build-version"
rm -rf "$dest"
mv "$tmp" "$dest"
touch "$marker"
echo "trainrec: libtorch installed in .libtorch/ ($(du -sh "$dest" | cut -f1))" >&2
