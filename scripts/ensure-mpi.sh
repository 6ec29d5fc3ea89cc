#!/usr/bin/env bash
# Provisions what the MPI backend (`trainrec-comm --features mpi`) needs: Open MPI (library,
# headers, mpirun) and libclang for the `mpi` crate's bindgen. Debian packages, about 10 s and
# 150 MB, installed once with apt-get (as root, or through sudo without a password).
# Exit 0 when MPI is ready; exit 1 with the reason when it cannot be installed here.
set -euo pipefail
ready() {
  command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 &&
    ls /usr/lib/x86_64-linux-gnu/libclang*.so* /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1
}
if ready; then
  exit 0
fi
packages=(libopenmpi-dev openmpi-bin libclang1-14 libclang-common-14-dev)
if [ "$(id -u)" = 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "trainrec: the MPI backend needs ${packages[*]} (apt-get), and this user can neither run apt-get nor sudo" >&2
  exit 1
fi
echo "trainrec: installing Open MPI for the MPI backend (${packages[*]}, about 150 MB, once)..." >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; then
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi
ready
