#!/usr/bin/env bash
# The peers' sources E7, E8 and E10 load at run time, into a git-ignored folder to carry to the GPU machine
# (nothing of them is committed):
#   <dest>/vllm/...           vLLM's fused_moe.py, its tuned configs and _version.py (MOEGEMM_VLLM_SOURCE), and
#                             quantization/utils/fp8_utils.py beside them (E10's block-FP8 activation quant)
#   <dest>/tk/triton_kernels  OpenAI's triton_kernels as vLLM ships it (vllm/third_party), and a REVISION file
#                             (MOEGEMM_TRITON_KERNELS_SOURCE)
# Both come from one vLLM wheel from the package index (or a wheel given as the second argument). E10's DeepGEMM
# is a checkout of its own (MOEGEMM_DEEPGEMM_SOURCE: git clone --recursive https://github.com/deepseek-ai/DeepGEMM),
# built on the GPU machine (experiments/deepgemm_peer.py).
#
#   bash experiments/fetch_peers.sh [dest, default .peers at the repository root] [vllm wheel]
#   export MOEGEMM_VLLM_SOURCE=$PWD/.peers/vllm/model_executor/layers/fused_moe/fused_moe.py
#   export MOEGEMM_TRITON_KERNELS_SOURCE=$PWD/.peers/tk
set -euo pipefail
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
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
