"""llama.cpp's converter for `bench.tiny_models like` checkpoints of another family:
`python -m bench.gguf_convert LLAMA_CPP_DIR MODEL_DIR [convert_hf_to_gguf.py's options]`.

The converter names a BPE tokenizer's pre-tokenizer by the hash of a test string's tokens, and stops on a hash
it does not know. SmolLM2's tokenizer, the only one a machine has offline, is known ("smollm") while its model
is a Llama; under a qwen2 config transformers loads the same tokenizer.json as a Qwen2Tokenizer, whose
pre-tokenizer splits the test string otherwise, and the converter stops. This runs the converter from
LLAMA_CPP_DIR (a checkout: the vendor/llama.cpp of the peer build in ../shared/peers/) with that name given, so
the file's tokenizer is SmolLM2's as llama.cpp reads it for the Llama shapes. Needs `sentencepiece` and
`protobuf` importable: the converter imports them before it looks at the tokenizer.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

PRE_TOKENIZER = "smollm"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    checkout = Path(argv[0])
    sys.path[:0] = [str(checkout), str(checkout / "gguf-py")]
    import conversion.base  # (the checkout's, from the path just set)
    for value in vars(conversion.base).values():
        if isinstance(value, type) and "get_vocab_base_pre" in vars(value):
            value.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    script = checkout / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
