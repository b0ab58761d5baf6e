"""bench_llamacpp's pure pieces: the build, convert and server command lines, and the ratios.

The benchmark itself (a ~10-minute build, two servers) is not part of the suite; these check
that what it would run is what its docstring promises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_llamacpp  # noqa: E402
import bench_serving  # noqa: E402
import llamacpp_build  # noqa: E402

from pagedserve.server.cli import build_parser  # noqa: E402


def test_build_is_the_server_and_quantize_targets_only_niced_offline_and_without_amx(tmp_path):
    configure = llamacpp_build.configure_command("cmake", tmp_path / "src", tmp_path / "build")
    for flag in ("-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"):
        assert flag in configure
    cxx_flags = next(f for f in configure if f.startswith("-DCMAKE_CXX_FLAGS="))
    assert "-mno-amx-int8" in cxx_flags and "-mno-amx-tile" in cxx_flags
    build = llamacpp_build.build_command("cmake", tmp_path / "build", jobs=2)
    assert build[:3] == ["nice", "-n", "19"]
    targets = build[build.index("--target") + 1 : build.index("-j")]
    assert targets == ["llama-server", "llama-quantize"] and build[-2:] == ["-j", "2"]
    source = llamacpp_build.source_dir(tmp_path)
    assert source.parts[-2:] == ("vendor", "llama.cpp")
    convert = llamacpp_build.convert_command(source, tmp_path / "model", tmp_path / "m.gguf")
    assert convert[1].endswith("convert_hf_to_gguf.py")
    assert convert[convert.index("--outtype") + 1] == "f32"
    deps = llamacpp_build.converter_deps_command(tmp_path / "deps")
    assert deps[deps.index("--target") + 1] == str(tmp_path / "deps")  # never the project's venv
    assert all("==" in requirement for requirement in llamacpp_build.CONVERTER_REQUIREMENTS)
    assert any(r.startswith("sentencepiece==") for r in llamacpp_build.CONVERTER_REQUIREMENTS)


def test_llama_server_runs_the_asked_threads_slots_and_kv_type(tmp_path):
    cmd = bench_llamacpp.llama_server_command(
        tmp_path / "llama-server", tmp_path / "m.gguf", 9000, 2, "f16", 16, 18400
    )
    pairs = dict(zip(cmd, cmd[1:]))
    assert pairs["-t"] == pairs["-tb"] == "2" and pairs["-np"] == "16"
    assert pairs["-ctk"] == pairs["-ctv"] == "f16" and pairs["-c"] == "18400"
    assert pairs["--port"] == "9000" and "--kv-unified" in cmd


def test_pagedserve_command_is_accepted_by_the_real_cli():
    cmd = bench_llamacpp.pagedserve_command("/models/x", 9001, 2, "float16")
    assert cmd[1:3] == ["-m", "pagedserve.server.cli"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.port, args.num_cpu_threads, args.kv_cache_dtype) == (9001, 2, "float16")
    assert bench_llamacpp.thread_env(2) == {"OMP_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}


def test_each_level_gets_its_own_seed_and_request_count():
    args = bench_llamacpp.parse_args(["--model", "/m", "--concurrency", "1", "16"] + [
        "--num-requests", "8", "64"
    ])  # fmt: skip
    one, sixteen = (
        bench_llamacpp.level_args(args, "http://h", c, n) for c, n in ((1, 8), (16, 64))
    )
    assert (one.concurrency, one.num_requests, sixteen.num_requests) == ([1], 8, 64)
    assert one.seed != sixteen.seed
    assert one.no_keepalive and sixteen.no_keepalive  # llama-server drops kept-alive connections
    workload = bench_serving.make_workload(one, one.vocab_size)
    assert workload == bench_serving.make_workload(one, one.vocab_size)  # seeded: same ids
    with pytest.raises(SystemExit):
        bench_llamacpp.parse_args(["--model", "/m", "--concurrency", "1", "16"])


def _summary(mode: str, tokens_per_s: float, tpot: float, ttft: float):
    pct = {name: {"p50": value, "p90": value, "p99": value} for name, value in (
        ("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2e", 1.0))}  # fmt: skip
    return bench_serving.RunSummary(mode, 4, 0, 1.0, 4.0, tokens_per_s, pct)


def test_ratios_are_ours_over_each_peer():
    results = {
        "pagedserve kv auto": {
            "runs": [_summary("c=1", 40.0, 25.0, 100.0), _summary("c=16", 300.0, 50.0, 400.0)],
            "long_ttft_ms": [900.0, 1000.0, 1100.0],
        },
        "llama.cpp kv f16": {
            "runs": [_summary("c=1", 50.0, 20.0, 50.0), _summary("c=16", 200.0, 80.0, 500.0)],
            "long_ttft_ms": [2000.0, 1900.0, 2100.0],
        },
    }
    rows = bench_llamacpp.ratio_rows(results, "pagedserve kv auto")
    assert rows[0] == ("llama.cpp kv f16", "c=1", 0.8, 1.25, 2.0)
    assert rows[1] == ("llama.cpp kv f16", "c=16", 1.5, 0.625, 0.8)
    assert rows[2][:2] == ("llama.cpp kv f16", "long prompt") and rows[2][4] == 1000.0 / 2000.0


def test_rounds_summary_is_the_median_and_range_of_each_ratio(capsys):
    peer = "llama.cpp kv f16"
    rounds = [
        [(peer, "c=1", 0.8, 1.2, 1.4), (peer, "c=16", 1.2, 0.9, 0.7)],
        [(peer, "c=1", 1.0, 1.0, 1.2), (peer, "c=16", 1.6, 0.7, 0.5)],
        [(peer, "c=1", 0.9, 1.1, 1.3), (peer, "c=16", 1.3, 0.8, 0.9)],
    ]
    bench_llamacpp.print_ratio_summary(rounds, "pagedserve kv auto")
    lines = capsys.readouterr().out.splitlines()
    assert "over 3 rounds" in lines[1]
    assert lines[3].split()[-6:] == ["0.90", "(0.80..1.00)", "1.10", "(1.00..1.20)", "1.30",
                                     "(1.20..1.40)"]  # fmt: skip
    assert lines[4].split()[-6:] == ["1.30", "(1.20..1.60)", "0.80", "(0.70..0.90)", "0.70",
                                     "(0.50..0.90)"]  # fmt: skip


def test_rounds_take_turns(monkeypatch, tmp_path):
    """Round 1 runs the servers in their listed order, round 2 in reverse, each measured."""
    order = []
    names = ["pagedserve kv auto", "llama.cpp kv f16"]
    listed = [bench_llamacpp.Server(name, ["x"], {}) for name in names]
    monkeypatch.setattr(bench_llamacpp, "servers", lambda *a: listed)
    monkeypatch.setattr(bench_llamacpp.bench_serving, "print_table", lambda runs: None)

    def measure(server, args, log_dir):
        order.append(server.name)
        return {"runs": [], "long_ttft_ms": []}

    monkeypatch.setattr(bench_llamacpp, "measure", measure)
    argv = ["--model", str(tmp_path), "--llamacpp-cache-type", "--rounds", "2"]
    argv += ["--log-dir", str(tmp_path / "logs"), "--long-prompt", "0"]
    assert bench_llamacpp.main(argv) == 0
    assert order == names + names[::-1]


def test_rounds_below_one_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench_llamacpp.parse_args(["--model", str(tmp_path), "--rounds", "0"])


def test_a_quantized_file_is_served_by_both_engines(tmp_path):
    """--gguf FILE: pagedserve and llama-server both serve FILE (and no fp32 floor is timed
    without the unquantized folder); --quantize runs llama.cpp's own quantizer."""
    args = bench_llamacpp.parse_args(["--gguf", str(tmp_path / "m-Q4_K_M.gguf")])
    assert not args.transformers_baseline
    listed = bench_llamacpp.servers(args, tmp_path / "llama-server", tmp_path / "m-Q4_K_M.gguf")
    for server in listed:
        assert str(tmp_path / "m-Q4_K_M.gguf") in server.command
    assert {s.name.split()[0] for s in listed} == {"pagedserve", "llama.cpp"}
    with pytest.raises(SystemExit):
        bench_llamacpp.parse_args(["--gguf", "/m.gguf", "--quantize", "Q8_0"])
    plain = bench_llamacpp.parse_args(["--model", str(tmp_path)])
    ours = bench_llamacpp.servers(plain, tmp_path / "s", tmp_path / "f32.gguf")[0]
    assert str(tmp_path) in ours.command and str(tmp_path / "f32.gguf") not in ours.command
    quantize = llamacpp_build.quantize_command(
        tmp_path / "llama-quantize", tmp_path / "f32.gguf", tmp_path / "q.gguf", "Q4_K_M", 2
    )
    assert quantize[1:] == [str(tmp_path / "f32.gguf"), str(tmp_path / "q.gguf"), "Q4_K_M", "2"]
    with pytest.raises(SystemExit):  # nothing to quantize: refused, not ignored
        llamacpp_build.main(["--quantize", "Q8_0"])


def test_the_1b_maker_writes_a_llama_transformers_loads(tmp_path, default_model_path):
    """tools/make_llama_1b.py: Llama-3.2-1B's shape over the default tokenizer (1.07B
    parameters, counted on the meta device), written here at a small shape that transformers
    loads with every tensor present and the tokenizer beside it."""
    import make_llama_1b
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    full = make_llama_1b.llama_config(Path(default_model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**full))
    assert 1.05e9 < sum(p.numel() for p in model.parameters()) < 1.09e9
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    out = make_llama_1b.write_llama(tmp_path / "llama", Path(default_model_path), **small)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.config.num_key_value_heads == 2 and loaded.config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(out).vocab_size == full["vocab_size"]
    weight = loaded.model.layers[1].mlp.down_proj.weight
    assert 0.015 < weight.std().item() < 0.025
