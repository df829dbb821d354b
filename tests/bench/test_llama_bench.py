"""bench.llama_bench and `bench.decode --llama-bench` against a stand-in llama-bench that answers as the real one
does (its JSON record) and writes down the arguments it was given."""
from __future__ import annotations

import json
import stat
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from bench import decode, llama_bench
from tests.support.tiny_gguf import write_gguf_file, write_gguf_model

AVG_NS = 48_000_000  # the stand-in's time for all of its tokens


def _stand_in(tmp_path, exit_code: int = 0):
    """An executable that records its argv and prints llama-bench's JSON: AVG_NS for its -n tokens."""
    binary = tmp_path / "llama-bench"
    binary.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        args = sys.argv[1:]
        open({str(tmp_path / "argv.json")!r}, "a").write(json.dumps(args) + "\\n")
        if {exit_code}:
            print("error: failed to load model", file=sys.stderr)
            sys.exit({exit_code})
        n_gen = int(args[args.index("-n") + 1])
        print(json.dumps([{{"n_prompt": 0, "n_gen": n_gen, "avg_ns": {AVG_NS}, "samples_ns": [{AVG_NS}]}}]))
    """))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary


def _calls(tmp_path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "argv.json").read_text().splitlines()]


def _gguf(path, names_shapes):
    return write_gguf_file(path, {name: np.zeros(shape, np.float32) for name, shape in names_shapes})


def test_a_tied_embedding_is_read_whole_and_an_untied_one_only_by_its_rows(tmp_path):
    tied = _gguf(tmp_path / "tied.gguf", [("token_embd.weight", (32, 8)), ("blk.0.ffn_up.weight", (16, 8)),
                                          ("output_norm.weight", (8,))])
    untied = _gguf(tmp_path / "untied.gguf", [("token_embd.weight", (32, 8)), ("blk.0.ffn_up.weight", (16, 8)),
                                              ("output_norm.weight", (8,)), ("output.weight", (32, 8))])
    assert llama_bench.step_weight_bytes(tied) == 4 * (32 * 8 + 16 * 8 + 8)
    assert llama_bench.step_weight_bytes(untied) == 4 * (16 * 8 + 8 + 32 * 8)


def test_each_run_is_set_against_the_probe_taken_just_before_it(tmp_path):
    binary = _stand_in(tmp_path)
    gguf = _gguf(tmp_path / "m.gguf", [("token_embd.weight", (1000, 100))])  # 400,000 bytes
    probes = iter([1.0, 4.0, 2.0])  # GB/s
    result = llama_bench.measure(str(binary), gguf, lambda: next(probes), context=100, tokens=8,
                                 kv_elements_per_token=125, threads=2)
    kv = 125 * 2 * (100 + 4)
    assert result["ms_per_token"] == AVG_NS / 8 / 1e6 and result["bandwidth_gb_s"] == 2.0
    assert result["weight_mb"] == 0.4 and result["kv_mb"] == kv / 1e6
    # the median of the three runs' ratios, the 2 GB/s one
    assert result["roofline_ratio"] == pytest.approx((400_000 + kv) / 2e9 / (AVG_NS / 8 / 1e9))
    assert _calls(tmp_path) == [["-m", str(gguf), "-p", "0", "-n", "8", "-d", "100", "-r", "1", "-t", "2",
                                 "-o", "json"]] * 3


def test_a_failing_llama_bench_is_reported_with_its_message(tmp_path):
    binary = _stand_in(tmp_path, exit_code=1)
    with pytest.raises(RuntimeError, match="exited with 1: error: failed to load model"):
        llama_bench.decode_ms(str(binary), tmp_path / "missing.gguf", context=10, tokens=4, threads=1)


def test_decode_times_llama_bench_on_the_models_own_gguf_file(tiny_llama_dir, tmp_path):
    binary = _stand_in(tmp_path)
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType.Q8_0)
    result = decode.run(str(gguf_dir), batches=(1, 2), context=40, steps=4, log=lambda _: None, num_kv_blocks=64,
                        llama_bench_binary=str(binary))
    one, two = result["rows"]
    assert "llama_bench" not in two  # batch 1 only: llama-bench decodes one sequence
    theirs = one["llama_bench"]
    assert theirs["ms_per_token"] == AVG_NS / 4 / 1e6 and theirs["roofline_ratio"] > 0
    assert theirs["weight_mb"] * 1e6 == llama_bench.step_weight_bytes(gguf_dir / "model.gguf")
    assert {tuple(call[call.index("-m"):call.index("-m") + 2]) for call in _calls(tmp_path)} == {
        ("-m", str(gguf_dir / "model.gguf"))}


def test_decode_refuses_llama_bench_without_a_gguf_file(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="is not a GGUF model"):
        decode.run(str(tiny_llama_dir), batches=(1,), context=40, steps=4, log=lambda _: None, num_kv_blocks=64,
                   llama_bench_binary=str(_stand_in(tmp_path)))
