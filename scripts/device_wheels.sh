#!/usr/bin/env bash
# Downloads the wheel bundle that Tessera needs on the lent GPU machine (one H100,
# x86_64, Python 3.12, torch 2.11.0+cu130, nvcc 13.0) and that its image lacks.
#
# That machine has no network: a package missing from its image travels as a wheel in
# an ignored folder of the working tree (the `carry` list of the device tool), and is
# installed there without an index:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#       --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Because that install takes no dependency resolution (--no-deps), this script pins the
# whole closure by hand: every package below is either a direct need of Tessera (or of
# its tests / FlashInfer backend) or a requirement of one that the image does not have.
# Packages the image already holds (torch, numpy, httpx, anyio, aiohttp, click, h11,
# jinja2, pyyaml, requests, tqdm, wrapt, python-dateutil, ...) are deliberately left out.
# See docs/gpu.md for the why of each entry and the measured size.
#
# Usage: scripts/device_wheels.sh [DEST]     (DEST defaults to .whl/ at the repo root)
#        PYTHON=python3.12 scripts/device_wheels.sh   (any Python with pip >= 20.3)
# DEST holds exactly this bundle: wheels already in it are removed first, since two
# versions of one package make the device-side install fail.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-$repo_root/.whl}
python=${PYTHON:-python3}
# The device tool carries at most 64 MiB of working tree; keep room for the repo itself.
max_mib=48

packages=(
    # --- FlashInfer attention backend (--attention-backend flashinfer) ---
    # 0.6.18.post1 is the newest release whose wheel is small (~18 MB; 0.7.x are
    # 34-62 MB). It is a pure-Python wheel that JIT-compiles its kernels with the
    # machine's nvcc (FlashInfer documents CUDA 12.6-13.1) through tvm-ffi, so its
    # kernels do not depend on the torch C++ ABI. `import flashinfer` and the batch
    # prefill/decode wrappers need none of its optional heavy requirements
    # (nvidia-cutlass-dsl, nvidia-cudnn-frontend, cuda-python, cuda-tile, nccl4py);
    # its other requirements (click, einops, ninja, numpy, nvidia-ml-py, packaging,
    # requests, tabulate, tqdm, torch) are in the image.
    flashinfer-python==0.6.18.post1
    # Imported by flashinfer at import time; a compiled wheel (cp312, manylinux_2_28).
    # flashinfer asks for >=0.1.6,<0.2 (not 0.1.8 / 0.1.8.post0).
    apache-tvm-ffi==0.1.15.post2

    # --- Tessera's own runtime dependencies missing from the image ---
    msgspec==0.22.0     # engine <-> server messages
    pyzmq==27.3.0       # engine <-> server transport (wheel bundles libzmq)
    blake3==1.0.11      # prefix-cache and image-cache keys
    pybase64==1.5.1     # data: URL decoding (SIMD base64)
    fastapi==0.165.0    # HTTP server
    starlette==1.10.0   # fastapi's base
    opentelemetry-api==1.45.2  # fastapi >= 0.16x imports it unconditionally
    pydantic==2.14.3    # fastapi/openai request and response models
    pydantic-core==2.50.4  # pydantic pins this exact version
    annotated-types==0.8.0    # pydantic
    typing-inspection==0.4.5  # pydantic, fastapi
    # pydantic 2.14 and pydantic-core need typing-extensions >= 4.16; the image's
    # version is not recorded, and a newer typing-extensions is backward compatible,
    # so the bundle brings its own (it shadows the image's through PYTHONPATH).
    typing-extensions==4.16.0
    # Plain uvicorn: Tessera forces http="h11" and runs its own asyncio loop, so the
    # [standard] extras (httptools, uvloop, websockets, watchfiles, dotenv) go unused.
    uvicorn==0.54.0
    # s3:// feature fetching: aioboto3 and its chain (aiohttp, multidict, wrapt and
    # python-dateutil are in the image). aioboto3 pins aiobotocore exactly, which pins
    # botocore/boto3 to a narrow window: these four move together.
    aioboto3==15.5.0
    aiobotocore==2.25.1
    boto3==1.40.61
    botocore==1.40.61
    s3transfer==0.14.0
    jmespath==1.1.0
    aioitertools==0.13.0

    # --- the `openai` client used by the e2e tests and benchmarks ---
    # 2.x, not 3.x: openai 3 moved from httpx (in the image) to httpx2 + httpcore2 +
    # truststore and wants newer anyio/idna than the image may have.
    openai==2.54.0
    distro==1.9.0
    jiter==0.19.0
    sniffio==1.3.1
)

# Python 3.12 CPython wheels for x86_64 Linux at manylinux_2_28 or older: the device
# runs glibc >= 2.28. pip matches each manylinux_2_N tag exactly, hence the list.
target=(
    --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64
)

mkdir -p "$dest"
rm -f "$dest"/*.whl
"$python" -m pip download --quiet --no-deps --only-binary=:all: "${target[@]}" \
    --dest "$dest" "${packages[@]}"

# One wheel per pinned package, nothing more (a stray second version breaks the install).
shopt -s nullglob
wheels=("$dest"/*.whl)
if ((${#wheels[@]} != ${#packages[@]})); then
    echo "error: expected ${#packages[@]} wheels in $dest, found ${#wheels[@]}" >&2
    exit 1
fi

# Largest first; the sum is what the device tool will count against its 64 MiB.
(cd "$dest" && stat -c '%10s  %n' -- *.whl) | sort -rn
total=0
for wheel in "${wheels[@]}"; do
    total=$((total + $(stat -c %s "$wheel")))
done
total_mib=$(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "total: ${#wheels[@]} wheels, $total bytes ($total_mib MiB) in $dest"
if ((total > max_mib * 1048576)); then
    echo "error: the bundle exceeds $max_mib MiB; the device tool carries 64 MiB in all" >&2
    exit 1
fi
