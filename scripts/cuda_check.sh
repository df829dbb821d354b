#!/usr/bin/env bash
# On a machine with a CUDA GPU (CI has none), in about five minutes: the CUDA kernels' tests compiled for the
# device, then random weights of SmolLM2-135M's and Llama-3.2-1B's shapes in bf16 (the GPU machine reaches no model
# hub) measured four ways: a 4,096-token prompt's prefill against the bf16 peak and its cached TTFT (1B shapes),
# decode steps against the roofline with plain transformers beside them, and the server on the GPU through HTTP
# (`bench serving`: one stream, 4 chats, 64 chats on a shared 2,000-token system prompt) against the same engine in
# process; then the CPU kernels' decode step on the host's CPU (Q4_0 at load), on all its cores and on two. Each
# stage has its own time limit (seconds, from the environment) and its own log, so one that fails or runs long
# leaves the others' figures; STAGES (names, space-separated) runs some of them only.
# usage: scripts/cuda_check.sh [SOURCE_DIR] [OUT_DIR]
#   SOURCE_DIR: a model directory whose config.json and tokenizer the random models take (default: the default
#   model's, downloaded here); OUT_DIR: where the logs, JSON and plots go (default bench/results/cuda).
set -uo pipefail
cd "$(dirname "$0")/.."
source_dir=${1:-}
out=${2:-bench/results/cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
[ -n "$source_dir" ] || source_dir=$($py -c "from engine.model.loader import resolve_model_path; print(resolve_model_path('default'))")

stages=" ${STAGES:-tests prefill sweep sweep_cached profile decode_1b decode_small serving cpu_decode cpu_decode_2} "
stage() {  # stage NAME SECONDS COMMAND...: runs it under its limit, its output to NAME.log and the screen
  local name=$1 limit=$2
  shift 2
  [[ $stages == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/summary.txt"
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$out/summary.txt"
echo "host CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) cores, widest vectors: \
$(grep -m1 -o -w -E 'avx512f' /proc/cpuinfo || grep -m1 -o -w avx2 /proc/cpuinfo)" | tee -a "$out/summary.txt"

# the random models, built on the CPU while the tests use the GPU
small=$out/smollm2-shapes
large=$out/llama-1b-shapes
(
  $py -m bench.tiny_models like "$source_dir" "$small" --bf16
  $py -m bench.tiny_models like "$source_dir" "$large" hidden_size=2048 intermediate_size=8192 \
    num_hidden_layers=16 num_attention_heads=32 num_key_value_heads=8 head_dim=64 --bf16
) >"$out/models.log" 2>&1 &
models=$!

stage tests "${TESTS_S:-150}" $py -m pytest -q -p no:cacheprovider -o filterwarnings=ignore --junitxml="$out/tests.xml" \
  tests/engine/model/test_paged_prefill_cuda.py tests/engine/model/test_paged_decode_cuda.py \
  tests/engine/model/test_fused_cuda.py tests/engine/model/test_decode_graph_cuda.py tests/engine/model/test_prefill_graph_cuda.py \
  "tests/engine/test_engine_hardening.py::test_seeded_sampling_on_cuda"
wait $models || { echo "building the random models failed:"; tail -20 "$out/models.log"; }

stage prefill "${PREFILL_S:-80}" $py -m bench.prefill --model "$large" --tokens 4096 --repeats 2 --gather-too --eager-too \
  --profile-host --json "$out/prefill_1b.json"
stage sweep "${SWEEP_S:-60}" $py -m bench.prefill --model "$large" --tokens 4096 --kernel-sweep \
  --json "$out/prefill_kernel_sweep.json"
stage sweep_cached "${SWEEP_S:-60}" $py -m bench.prefill --model "$large" --tokens 4096 --queries 16 --kernel-sweep \
  --json "$out/prefill_kernel_sweep_cached.json"
stage profile "${PROFILE_S:-60}" bash -c "$py -m bench.step_profile --device cuda --dtype bfloat16 --model $large \
  --prefill 4096 --top 30 --json $out/profile_prefill_4096.json && $py -m bench.step_profile --device cuda \
  --dtype bfloat16 --model $large --prefill 16 --top 12 --json $out/profile_prefill_16.json"
stage decode_1b "${DECODE_S:-60}" $py -m bench.decode --device cuda --dtype bfloat16 --model "$large" --steps 32 \
  --batches 1,8,32 --json "$out/decode_1b.json" --plot "$out/decode_1b.png"
stage decode_small "${DECODE_S:-60}" $py -m bench.decode --device cuda --dtype bfloat16 --model "$small" --steps 32 \
  --batches 1,8,32 --transformers --json "$out/decode_small.json"
stage serving "${SERVING_S:-170}" $py -m bench serving --model "$small" --device cuda --max-num-seqs 64 \
  --tokens 200 --turns 2 --think-s 0.5 --no-thread-mode --many-chats 64 --many-prefix-tokens 2000 --many-turns 2 \
  --transformers --out "$out"
# the CPU kernels on this host's CPU (AVX-512 where it has it; the project's own machine has AVX2 only): the
# default model's shapes quantized to Q4_0 at load, a batch-1 decode step against the roofline of the bytes it
# reads; numba compiles the kernels for this CPU first (minutes)
stage cpu_decode "${CPU_S:-300}" $py -m bench.decode --device cpu --model "$small" --quantization q4_0 --batches 1,8 \
  --steps 16 --context 968 --json "$out/cpu_decode_q4_0.json"
# the same on two of its cores (the kernels compiled above), as on the 2-core machines the CPU targets are set on
stage cpu_decode_2 "${CPU_S:-300}" taskset -c 0,1 $py -m bench.decode --device cpu --model "$small" \
  --quantization q4_0 --batches 1,8 --steps 16 --context 968 --json "$out/cpu_decode_q4_0_2cores.json"
cat "$out/summary.txt"
