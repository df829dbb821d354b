"""bench.gguf_convert against a stand-in llama.cpp checkout whose converter, like the real one, stops on a
pre-tokenizer hash it does not know."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _checkout(root: Path) -> Path:
    (root / "gguf-py").mkdir(parents=True)
    (root / "conversion").mkdir()
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text(textwrap.dedent("""
        class TextModel:
            def get_vocab_base_pre(self, tokenizer):
                raise NotImplementedError("BPE pre-tokenizer was not recognized")
    """))
    (root / "convert_hf_to_gguf.py").write_text(textwrap.dedent("""
        import sys
        from conversion.base import TextModel
        if __name__ == "__main__":
            out = sys.argv[sys.argv.index("--outfile") + 1]
            open(out, "w").write(sys.argv[1] + " " + TextModel().get_vocab_base_pre(None))
    """))
    return root


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gguf_convert", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_converter_runs_with_the_pre_tokenizer_named(tmp_path):
    checkout = _checkout(tmp_path / "llama.cpp")
    out = tmp_path / "model.gguf"
    done = _convert(str(checkout), "MODEL_DIR", "--outtype", "f32", "--outfile", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "MODEL_DIR smollm"  # the model's arguments passed on, the hash check answered


def test_without_a_model_it_says_how_to_call_it(tmp_path):
    done = _convert(str(tmp_path))
    assert done.returncode != 0 and "LLAMA_CPP_DIR MODEL_DIR" in done.stderr
