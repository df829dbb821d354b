"""What a GGUF file's metadata says beyond what transformers reads from it: rope scaling (llama 3's per-frequency
factors as a tensor, linear and YaRN in the metadata), the tokens a turn ends with, and a split file refused."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from engine.model.gguf_index import write_index
from engine.model.gguf_loader import ROPE_FACTORS, _set_rope_scaling, gguf_model_dir
from engine.model.llama import RotaryEmbedding
from engine.model.model_config import load_config
from tests.support.tiny_gguf import write_gguf_file

THETA, HEAD_DIM = 500000.0, 64
LLAMA3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factors() -> list[float]:
    """The divisors llama.cpp's converter writes as rope_freqs.weight for llama 3's rope scaling."""
    factors = []
    for freq in 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelength = 2 * math.pi / freq
        low, high = (LLAMA3["original_max_position_embeddings"] / LLAMA3[k] for k in ("low_freq_factor",
                                                                                         "high_freq_factor"))
        if wavelength < high:
            factors.append(1.0)
        elif wavelength > low:
            factors.append(LLAMA3["factor"])
        else:
            smooth = (LLAMA3["original_max_position_embeddings"] / wavelength - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / LLAMA3["factor"] + smooth))
    return factors


def write_gguf(path: Path, metadata: dict | None = None, factors: list[float] | None = None) -> Path:
    """A GGUF file with a llama architecture, the given metadata and (where given) a rope_freqs tensor."""
    tensors = {"token_embd.weight": np.zeros((4, 8), np.float32)}
    if factors is not None:
        tensors[ROPE_FACTORS] = np.asarray(factors, np.float32)
    return write_gguf_file(path, tensors, metadata)


def test_llama3_rope_factors_give_transformers_llama3_frequencies(tiny_llama_dir, tmp_path):
    """A Llama 3.x GGUF holds its rope scaling as rope_freqs.weight alone; config.json takes the factors and the
    engine divides the frequencies by them, as llama.cpp does: transformers' llama3 rope to the last bit."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    gguf = write_gguf(tmp_path / "llama3.gguf", factors=llama3_factors())
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": THETA}, max_position_embeddings=8)
    _set_rope_scaling(config, gguf, write_index(gguf, tmp_path))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    raw = {**json.loads((tiny_llama_dir / "config.json").read_text()), "head_dim": HEAD_DIM,
           "rope_parameters": config.rope_parameters, "rope_freq_factors": config.rope_freq_factors}
    (model_dir / "config.json").write_text(json.dumps(raw))
    ours = RotaryEmbedding(load_config(model_dir), HEAD_DIM).inv_freq
    reference = LlamaConfig(head_dim=HEAD_DIM, rope_parameters={"rope_type": "llama3", "rope_theta": THETA, **LLAMA3})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](reference)
    plain = RotaryEmbedding(SimpleNamespace(rope_parameters={"rope_theta": THETA}), HEAD_DIM).inv_freq
    assert not torch.allclose(ours, plain)  # (factors that scale: 17 of the 32 frequencies)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("metadata, expected", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 32768},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ({"llama.rope.scaling.type": "none"}, {}),
])
def test_rope_scaling_in_the_metadata_reaches_the_config(tmp_path, metadata, expected):
    gguf = write_gguf(tmp_path / "scaled.gguf", metadata)
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, max_position_embeddings=8)
    _set_rope_scaling(config, gguf, write_index(gguf, tmp_path))
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4, **expected}
    assert not hasattr(config, "rope_freq_factors")


def test_a_rope_scaling_we_cannot_run_is_named(tmp_path):
    gguf = write_gguf(tmp_path / "longrope.gguf", {"llama.rope.scaling.type": "longrope"})
    config = SimpleNamespace(rope_parameters={}, max_position_embeddings=8)
    with pytest.raises(ValueError, match="rope scaling 'longrope' is not supported"):
        _set_rope_scaling(config, gguf, write_index(gguf, tmp_path))


def test_a_part_of_a_split_file_is_refused_with_the_way_to_merge_it(tmp_path):
    gguf = write_gguf(tmp_path / "model-00001-of-00002.gguf", {"split.no": 0, "split.count": 2})
    with pytest.raises(ValueError, match=r"one of 2 parts of a split GGUF.*llama-gguf-split --merge"):
        gguf_model_dir(gguf, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # no half-built directory left behind


@pytest.mark.default_model
def test_a_file_with_an_end_of_turn_token_stops_on_it_and_is_served_by_its_own_name(tmp_path):
    """The default model's tokenizer in a tiny file whose EOS is <|endoftext|> (0) and end of turn <|im_end|> (2),
    as llama.cpp's converter writes such files: the engine stops on both (and on the other end texts its
    vocabulary has), as llama.cpp does; the model is served by the file's name, not the cache's key."""
    from gguf import GGUFReader, GGUFValueType

    from engine.async_engine import served_name
    from engine.model.default_model import ensure_default_model
    from engine.model.gguf_loader import WEIGHTS_NAME

    source = GGUFReader(ensure_default_model() / WEIGHTS_NAME)
    writer = GGUFWriter(tmp_path / "chat.gguf", "llama")
    for key, field in source.fields.items():
        if key.startswith(("GGUF.", "llama.")) or key in ("general.architecture", "tokenizer.ggml.eos_token_id"):
            continue
        kind = field.types[0]
        add = {GGUFValueType.ARRAY: writer.add_array, GGUFValueType.STRING: writer.add_string,
               GGUFValueType.BOOL: writer.add_bool, GGUFValueType.UINT32: writer.add_uint32,
               GGUFValueType.FLOAT32: writer.add_float32}[kind]
        add(key, field.contents())
    writer.add_uint32("tokenizer.ggml.eos_token_id", 0)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 2)
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("vocab_size", 49152), ("rope.dimension_count", 16)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 1e4)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((49152, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model_dir = gguf_model_dir(tmp_path / "chat.gguf", tmp_path / "cache")
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    core = SimpleNamespace(config=SimpleNamespace(model=str(tmp_path / "chat.gguf")), model_path=model_dir)
    assert model_dir.name.startswith("chat-") and served_name(core) == "chat"


@pytest.mark.default_model
def test_a_default_model_converted_before_end_tokens_gets_them(tmp_path):
    """The default model's directory converted by an earlier version (no eos_token_id in its generation_config.json)
    gets the file's end tokens at the next start, as a fresh conversion writes them."""
    from engine.model.default_model import DEFAULT_MODEL_DIR, ensure_default_model
    from engine.model.gguf_loader import WEIGHTS_NAME

    source = ensure_default_model()
    old = tmp_path / DEFAULT_MODEL_DIR
    old.mkdir()
    for path in source.iterdir():
        if path.name == WEIGHTS_NAME:
            (old / WEIGHTS_NAME).symlink_to(path)
        elif path.is_file():
            (old / path.name).write_bytes(path.read_bytes())
    generation = json.loads((old / "generation_config.json").read_text())
    generation.pop("eos_token_id", None)
    (old / "generation_config.json").write_text(json.dumps(generation))
    assert ensure_default_model(tmp_path) == old
    upgraded = json.loads((old / "generation_config.json").read_text())
    assert upgraded == {**generation, "eos_token_id": [0, 2]}  # <|endoftext|> and <|im_end|>; the rest kept
