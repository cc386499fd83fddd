#!/usr/bin/env bash
# The peers' sources E7, E8 and E10 load at run time, into a git-ignored folder to carry to the GPU machine
# (nothing of them is committed):
#   <dest>/vllm/...           vLLM's fused_moe.py, its tuned configs and _version.py (MOEGEMM_VLLM_SOURCE), and
#                             quantization/utils/fp8_utils.py beside them (E10's block-FP8 activation quant)
#   <dest>/tk/triton_kernels  OpenAI's triton_kernels as vLLM ships it (vllm/third_party), and a REVISION file
#                             (MOEGEMM_TRITON_KERNELS_SOURCE)
#   <dest>/deepgemm.tar.xz    DeepSeek's DeepGEMM at DEEPGEMM_REVISION, with the headers of its submodules
#                             (CUTLASS, fmt) at the commits it pins, and a REVISION file: the folder deepgemm/
#                             (about 30 MB, the submodules' include/ trees only) packed; unpacked, its path is
#                             MOEGEMM_DEEPGEMM_SOURCE (DEEPGEMM_KEEP_TREE=1 keeps it unpacked in <dest> too);
#                             its extension is built on the GPU machine (experiments/deepgemm_peer.py).
#                             DEEPGEMM=0 skips it.
# vLLM's and triton_kernels come from one vLLM wheel from the package index (or a wheel given as the second
# argument); DeepGEMM from its git repository (DEEPGEMM_URL; the submodules' from its .gitmodules).
#
#   bash experiments/fetch_peers.sh [dest, default .peers at the repository root] [vllm wheel]
#   export MOEGEMM_VLLM_SOURCE=$PWD/.peers/vllm/model_executor/layers/fused_moe/fused_moe.py
#   export MOEGEMM_TRITON_KERNELS_SOURCE=$PWD/.peers/tk
#   tar -xJf .peers/deepgemm.tar.xz -C /tmp && export MOEGEMM_DEEPGEMM_SOURCE=/tmp/deepgemm
set -euo pipefail
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
DEEPGEMM_REVISION=${DEEPGEMM_REVISION:-54e22612409371d6364144b69086735beb54e98b}
DEEPGEMM_URL=${DEEPGEMM_URL:-https://github.com/deepseek-ai/DeepGEMM}
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.peers}
wheel=${2:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [[ -z $wheel ]]; then
  python -m pip download "vllm==$VLLM_VERSION" --no-deps --only-binary=:all: -d "$tmp" >&2
  wheel=$(ls "$tmp"/vllm-*.whl)
fi
rm -rf "$dest/vllm" "$dest/tk"
mkdir -p "$dest/tk"
unzip -q "$wheel" -d "$dest" 'vllm/_version.py' 'vllm/model_executor/layers/fused_moe/fused_moe.py' \
  'vllm/model_executor/layers/fused_moe/configs/*' 'vllm/third_party/triton_kernels/*' \
  'vllm/model_executor/layers/quantization/utils/fp8_utils.py'
mv "$dest/vllm/third_party/triton_kernels" "$dest/tk/triton_kernels"
rm -rf "$dest/vllm/third_party"
version=$(sed -n "s/^__version__ = version = '\(.*\)'/\1/p" "$dest/vllm/_version.py")
commit=$(sed -n "s/^__commit_id__ = commit_id = '\(.*\)'/\1/p" "$dest/vllm/_version.py")
echo "as shipped in vllm $version ($commit), vllm/third_party/triton_kernels" > "$dest/tk/REVISION"
echo "peers in $dest ($(du -sh "$dest" | cut -f1)): vllm $version ($commit)"
echo "triton_kernels: $(cat "$dest/tk/REVISION")"
if [[ ${DEEPGEMM:-1} == 1 ]]; then
  checkout() {  # checkout <url> <commit> <dir> [path]: <commit> (of it only <path>) in <dir>, no other blob fetched
    git clone -q --filter=blob:none --no-checkout "$1" "$3"
    if [[ -n ${4:-} ]]; then git -C "$3" sparse-checkout set --no-cone "/$4/"; fi
    git -C "$3" -c advice.detachedHead=false checkout -q "$2"
  }
  rm -rf "$dest/deepgemm"
  checkout "$DEEPGEMM_URL" "$DEEPGEMM_REVISION" "$tmp/dg"
  mkdir -p "$dest/deepgemm"
  git -C "$tmp/dg" archive "$DEEPGEMM_REVISION" | tar -x -C "$dest/deepgemm"
  for sub in cutlass fmt; do  # the submodules' headers, at the commits DeepGEMM pins
    url=$(git config -f "$dest/deepgemm/.gitmodules" "submodule.third-party/$sub.url")
    pin=$(git -C "$tmp/dg" ls-tree "$DEEPGEMM_REVISION" "third-party/$sub" | awk '{print $3}')
    checkout "$url" "$pin" "$tmp/$sub" include
    cp -r "$tmp/$sub/include" "$dest/deepgemm/third-party/$sub/"
  done
  echo "$DEEPGEMM_REVISION" > "$dest/deepgemm/REVISION"
  # packed: the headers shrink about tenfold, so that the peers fit in a GPU call's carry beside the Triton
  # bundle; unpacked on the GPU machine (tar -xJf <dest>/deepgemm.tar.xz -C <dir>)
  rm -f "$dest/deepgemm.tar.xz"
  tar -cJf "$dest/deepgemm.tar.xz" -C "$dest" deepgemm
  [[ ${DEEPGEMM_KEEP_TREE:-0} == 1 ]] || rm -rf "$dest/deepgemm"
  echo "DeepGEMM: $DEEPGEMM_REVISION in $dest/deepgemm.tar.xz ($(du -sh "$dest/deepgemm.tar.xz" | cut -f1))"
fi
