#!/usr/bin/env bash
# Provisions NVRTC (CUDA 13.0's run-time compiler, from PyPI's nvidia-cuda-nvrtc wheel: a 90 MB
# download, 110 MB installed) into the git-ignored folder .cuda/ when it is missing. NVRTC needs
# no GPU: the tests compile the CUDA kernels to PTX with it on any machine. Idempotent (marker
# file).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.cuda"
version=13.0.88
marker="$dest/.complete-nvrtc-$version"
if [ -f "$marker" ]; then
  exit 0
fi
echo "trainrec: NVRTC $version not found under .cuda/, installing it from PyPI (about 90 MB, once)..." >&2
tmp="$root/.cuda.partial"
rm -rf "$tmp"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$tmp" \
  "nvidia-cuda-nvrtc==$version"
test -f "$tmp/nvidia/cu13/lib/libnvrtc.so.13"
# The wheel also ships an alternative build of each library (".alt"), which nothing loads.
rm -f "$tmp"/nvidia/cu13/lib/*.alt.so*
rm -rf "$dest"
mv "$tmp" "$dest"
touch "$marker"
echo "trainrec: NVRTC installed in .cuda/ ($(du -sh "$dest" | cut -f1))" >&2
