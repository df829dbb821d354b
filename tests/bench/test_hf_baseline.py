"""bench's plain-transformers baseline on a GGUF model directory: the same weights as the checkpoint it was
written from, so the same logits."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import AutoModelForCausalLM

from bench.hf_baseline import hf_model
from tests.support.tiny_gguf import write_gguf_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_directory_is_its_checkpoints_model(arch, request, tmp_path):
    """llama's q/k rows permuted back, the tied lm_head tied: logits equal to the source checkpoint's."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    gguf_dir = write_gguf_model(model_dir, tmp_path / "gguf", lambda name: QType.F32)
    ids = torch.arange(3, 40)[None, :]
    with torch.inference_mode():
        got = hf_model(str(gguf_dir))(ids).logits
        want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)

