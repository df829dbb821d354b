#!/usr/bin/env bash
# On a machine with a CUDA GPU (CI has none): the CUDA tests, then decode speed against the roofline with
# CUDA graphs, without them (--enforce-eager) and plain transformers, then the prefill kernel's throughput and a
# cached prompt's TTFT at Llama-3.2-1B's layer shapes (random weights beside MODEL_DIR's tokenizer), in one run.
# usage: scripts/cuda_check.sh [MODEL_DIR] [OUT_DIR]   (MODEL_DIR: default, or a stand-in from
#        `python -m bench.tiny_models like SOURCE OUT` where the weights cannot be fetched)
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:-default}
out=${2:-bench/results}
mkdir -p "$out"
python -m pytest -q -o filterwarnings=ignore::DeprecationWarning tests/engine/model/test_fused_cuda.py tests/engine/model/test_paged_decode_cuda.py \
  tests/engine/model/test_paged_prefill_cuda.py tests/engine/model/test_decode_graph_cuda.py "tests/engine/test_engine_hardening.py::test_seeded_sampling_on_cuda"
decode() { python -m bench.decode --device cuda --model "$model" --steps 32 "$@"; }
decode --dtype bfloat16 --batches 1,4,8,16,32 --transformers --json "$out/decode_cuda_bf16.json"
decode --dtype bfloat16 --batches 1,4,8,16,32 --enforce-eager --json "$out/decode_cuda_bf16_eager.json"
decode --dtype float32 --batches 1,8,32 --transformers --json "$out/decode_cuda_fp32.json"
decode --dtype bfloat16 --batches 1,8 --shared-prefix 960 --json "$out/decode_cuda_bf16_shared.json"
python -m bench.decode --replot "$out/decode_cuda_bf16.json" "$out/decode_cuda_bf16_eager.json" \
  --plot "$out/decode_cuda_bf16.png"
# prefill of a 4,096-token prompt in one step (FLOPs / time against the bf16 peak), then the same prompt fully
# cached, with the gather path's uncached TTFT beside it
source=$(python -c "import sys; from engine.model.loader import resolve_model_path; print(resolve_model_path(sys.argv[1]))" "$model")
shapes_1b="$out/llama-1b-shapes"
[ -f "$shapes_1b/config.json" ] || python -m bench.tiny_models like "$source" "$shapes_1b" hidden_size=2048 \
  intermediate_size=8192 num_hidden_layers=16 num_attention_heads=32 num_key_value_heads=8 --bf16
python -m bench.prefill --model "$shapes_1b" --tokens 4096 --gather-too --json "$out/prefill_cuda_1b_shapes.json"
