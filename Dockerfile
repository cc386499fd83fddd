# moegemm: the pinned PyTorch nightly CUDA image with TeX and the project, running the whole pipeline.
#
#   docker build --build-arg MOEGEMM_COMMIT=$(git rev-parse HEAD) -t moegemm .
#   docker run --rm --gpus all -v $PWD/results:/work/results -v $PWD/figures:/work/figures -v $PWD/paper:/work/paper moegemm
#
# The three folders mounted from the checkout the image was built from: what the run measures (results/), and
# the figures and the paper it rebuilds from them (figures/<gpu>/, paper/paper.pdf), kept after the container
# exits.
#
# Base: the PyTorch nightly the seed study measured with (torch 2.12.0.dev20260408, CUDA 12.8; it ships
# Triton as the `pytorch-triton` package). Which torch and Triton a result used is in its CSV rows (the
# README's headline names them, from those rows): the committed H200 results came from torch 2.11.0+cu130
# (the lent GPU machine's image) with Triton 3.7.1 (the Triton torch 2.13 requires; torch 2.12 requires 3.7.0,
# and this image's nightly ships the 3.7 line). At start the container prints its own torch and
# Triton and records them in results/<gpu>/image_versions.json (the ENTRYPOINT below).
FROM ghcr.io/pytorch/pytorch-nightly:2.12.0.dev20260408-cuda12.8-cudnn9-devel

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends git unzip latexmk texlive-latex-base texlive-latex-recommended \
      texlive-latex-extra texlive-fonts-recommended \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /work
COPY . /work

# The image's torch and Triton stay as they are (the nightly ships Triton as `pytorch-triton`), so the
# project installs without dependency resolution, and the pipeline/test tools install at the exact
# versions pinned in pyproject.toml's `pipeline` and `test` extras.
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print('\n'.join(d['pipeline'] + d['test']))" > /tmp/pinned.txt \
 && pip install -r /tmp/pinned.txt \
 && pip install --no-deps -e .

# vLLM's fused-MoE Triton kernel, E7's optional contender: vLLM's wheel is downloaded (hash-pinned), not
# installed (vLLM pins a torch of its own); experiments/vllm_moe.py reads the kernel out of the wheel.
RUN echo "vllm==0.33.0 --hash=sha256:4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa" > /tmp/vllm.txt \
 && pip download --no-deps --only-binary=:all: --require-hashes -r /tmp/vllm.txt -d /opt/vllm
ENV MOEGEMM_VLLM_SOURCE=/opt/vllm/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
# OpenAI's triton_kernels (E7's and E8's "tk: ..." contender) as that wheel ships it (vllm/third_party),
# unpacked by the script that prepares the GPU machine's peers (experiments/fetch_peers.sh)
RUN bash experiments/fetch_peers.sh /opt/peers "$MOEGEMM_VLLM_SOURCE"
ENV MOEGEMM_TRITON_KERNELS_SOURCE=/opt/peers/tk

# Unsloth's Triton MoE kernels, E9's "unsloth: ..." contender and tune_unsloth's: a clone at the revision
# measured, read at run time (experiments/unsloth_moe.py imports only its grouped-GEMM package)
RUN git clone --quiet https://github.com/unslothai/unsloth /opt/unsloth \
 && git -C /opt/unsloth checkout --quiet 015bdef0d94a241bcd94eec7a405b1700632180d
ENV MOEGEMM_UNSLOTH_SOURCE=/opt/unsloth

# The seed author's Triton Decompose-K kernels, the contenders "seed: original" and "seed: optimized" of
# E3-E6: a clone at the commit we measured, read at run time (experiments/seed_dk.py); nothing of it is
# part of this project.
RUN git clone --quiet https://github.com/shreyansh26/MLSys-Experiments /opt/seed \
 && git -C /opt/seed checkout --quiet b63fb8c71bc0019205404d1b979a519ee8a748d0
ENV MOEGEMM_SEED_SOURCE=/opt/seed/decompose-k

# The source tree has no .git inside the image: provenance records the commit passed at build time.
ARG MOEGEMM_COMMIT=unknown
ENV MOEGEMM_COMMIT=${MOEGEMM_COMMIT}

# Every start: print the image's torch, Triton (its `pytorch-triton` distribution) and CUDA, write them to
# results/<gpu>/image_versions.json (the folder this machine's results go to), then run the command.
RUN printf '%s\n' \
      'import datetime, importlib.metadata as md, json, os, pathlib, sys' \
      'sys.path.insert(0, os.getcwd())  # the project folder (WORKDIR), for experiments.pipeline' \
      'import torch, triton' \
      'from experiments.pipeline import local_gpus, machine_slug' \
      'def dist(names):' \
      '    for name in names:' \
      '        try:' \
      '            return f"{name} {md.version(name)}"' \
      '        except md.PackageNotFoundError:' \
      '            pass' \
      '    return "none"' \
      'v = {"torch": torch.__version__, "triton": triton.__version__,' \
      '     "triton_distribution": dist(["pytorch-triton", "triton"]), "cuda": torch.version.cuda,' \
      '     "python": sys.version.split()[0], "git_commit": os.environ.get("MOEGEMM_COMMIT", "unknown"),' \
      '     "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}' \
      'print("moegemm image: torch %s, Triton %s (%s), CUDA %s"' \
      '      % (v["torch"], v["triton"], v["triton_distribution"], v["cuda"]), flush=True)' \
      'out = pathlib.Path("results") / machine_slug(local_gpus()) / "image_versions.json"' \
      'out.parent.mkdir(parents=True, exist_ok=True)' \
      'out.write_text(json.dumps(v, indent=1) + "\n")' \
    > /usr/local/bin/moegemm-versions.py
ENTRYPOINT ["/bin/sh", "-c", "python /usr/local/bin/moegemm-versions.py && exec \"$@\"", "moegemm"]
CMD ["snakemake", "--cores", "1"]
