#!/usr/bin/env bash
# A wheelhouse for a CUDA machine without internet access (clusters often have none), built on a machine
# with it: every wheel swarmtrain needs beyond a PyTorch image (torch with CUDA, numpy, scipy, tokenizers,
# safetensors, transformers, matplotlib, prometheus-client, pytest are expected there), for the GPU
# machine's Python and platform, plus a wheel of swarmtrain itself. About 25 MB.
#   Usage: tools/gpu/wheelhouse.sh DIR [PYTHON_VERSION]   (default 3.12, manylinux x86_64)
# Then on the GPU machine: tools/gpu/check.sh DIR   (or: make gpu-check WHEELS=DIR)
set -euo pipefail
dir=${1:?usage: tools/gpu/wheelhouse.sh DIR [PYTHON_VERSION]}; py=${2:-3.12}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
platforms=""
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $p"
done
binary="--no-deps --only-binary=:all: --python-version $py --implementation cp $platforms"
# hivemind and what it needs beyond such an image; the data plane's cryptography; the tokenize job's zstd
for package in hivemind==1.1.12 configargparse py-multihash base58 netaddr py-cid py-multibase \
        py-multicodec morphys 'pydantic>=2,<3' pydantic-core annotated-types typing-inspection \
        typing-extensions cryptography cffi pycparser bottle zstandard blake3 mmh3 py-spy pytest-timeout; do
    echo "wheelhouse: $package"
    python3 -m pip download -q $binary -d "$dir" "$package"
done
# published as source only: built here (pure Python, so the wheels fit any platform)
python3 -m pip wheel -q --no-deps -w "$dir" prefetch_generator varint python-baseconv
python3 -m pip wheel -q --no-deps -w "$dir" "$root"
echo "wheelhouse: $(ls "$dir" | wc -l) wheels in $dir"
