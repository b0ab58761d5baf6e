"""Build llama.cpp's ``llama-server`` and ``llama-quantize`` from PyPI's source package, convert an
HF folder to GGUF and quantize it with llama.cpp's own tool.

The peer benchmark (tools/bench_llamacpp.py) needs a llama.cpp it can trust to be the real thing,
built on this machine for this CPU (``GGML_NATIVE``), with no network beyond PyPI: the
``llama-cpp-python`` sdist vendors the whole llama.cpp tree (``vendor/llama.cpp``), its
``convert_hf_to_gguf.py`` and its ``gguf-py``. Only the ``llama-server`` and ``llama-quantize``
targets are built (the whole tree takes several times longer), at ``nice 19`` so the machine's
other users keep their cores, and the result is cached under ``$PAGEDSERVE_HOME/llamacpp``: a
second run reuses it.

    .venv/bin/python tools/llamacpp_build.py            # build (about 10 minutes on 2 cores)
    .venv/bin/python tools/llamacpp_build.py --convert FOLDER --quantize Q4_K_M Q8_0
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# What llama.cpp's converter imports beyond torch, numpy and transformers (its
# requirements-convert_legacy_llama.txt): installed into the cache, never into the project's venv.
CONVERTER_REQUIREMENTS = ["sentencepiece==0.2.3", "protobuf==4.25.8"]


def cache_dir() -> Path:
    home = os.environ.get("PAGEDSERVE_HOME") or Path.home() / ".cache" / "pagedserve"
    return Path(home) / "llamacpp"


def source_dir(cache: Path) -> Path:
    """The vendored llama.cpp tree inside the extracted sdist."""
    return cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


BUILT_TARGETS = ("llama-server", "llama-quantize")


def server_binary(cache: Path) -> Path:
    return cache / "build" / "bin" / "llama-server"


def quantize_binary(cache: Path) -> Path:
    return cache / "build" / "bin" / "llama-quantize"


def download_command(cache: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
        "-d",
        str(cache / "src"),
    ]


def configure_command(cmake: str, source: Path, build: Path) -> list[str]:
    """CPU-only Release build of the server; nothing that reaches the network (no prebuilt web
    UI, no curl/openssl), no tests or examples. Native for this CPU, but with AMX off: a VM may
    advertise AMX and refuse its tiles (the native build crashed on a quantized file on the
    Intel VM), while AVX-512 and VNNI stay on where the CPU has them."""
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    flags = {
        "CMAKE_BUILD_TYPE": "Release",
        "GGML_NATIVE": "ON",
        "CMAKE_C_FLAGS": no_amx,
        "CMAKE_CXX_FLAGS": no_amx,
        "BUILD_SHARED_LIBS": "OFF",
        "LLAMA_CURL": "OFF",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_SERVER": "ON",
        "LLAMA_BUILD_TOOLS": "ON",
    }
    return [cmake, "-S", str(source), "-B", str(build), *(f"-D{k}={v}" for k, v in flags.items())]


def build_command(cmake: str, build: Path, jobs: int) -> list[str]:
    return ["nice", "-n", "19", cmake, "--build", str(build), "--target", *BUILT_TARGETS] + [
        "-j",
        str(jobs),
    ]


def find_cmake(cache: Path) -> str:
    """The system's cmake, else PyPI's ``cmake`` wheel installed into the cache."""
    found = shutil.which("cmake")
    if found:
        return found
    target = cache / "cmake"
    if not (target / "bin" / "cmake").exists():
        pip = [sys.executable, "-m", "pip", "install", "--prefix", str(target), "cmake"]
        subprocess.run(pip, check=True)
    return str(next(target.glob("**/bin/cmake")))


def fetch_source(cache: Path) -> Path:
    source = source_dir(cache)
    if not (source / "CMakeLists.txt").exists():
        (cache / "src").mkdir(parents=True, exist_ok=True)
        subprocess.run(download_command(cache), check=True)
        archive = next((cache / "src").glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")
    return source


def build_llama_server(cache: Path | None = None, jobs: int = 2) -> Path:
    """The ``llama-server`` binary (and ``llama-quantize`` beside it), built once and cached."""
    cache = cache or cache_dir()
    binary = server_binary(cache)
    if binary.exists() and quantize_binary(cache).exists():
        return binary
    source = fetch_source(cache)
    cmake = find_cmake(cache)
    subprocess.run(configure_command(cmake, source, cache / "build"), check=True)
    subprocess.run(build_command(cmake, cache / "build", jobs), check=True)
    return binary


def convert_command(source: Path, model_dir: Path, outfile: Path) -> list[str]:
    return [
        sys.executable,
        str(source / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outtype",
        "f32",
        "--outfile",
        str(outfile),
    ]


def converter_deps_command(target: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target)] + (
        CONVERTER_REQUIREMENTS
    )


def converter_deps(cache: Path) -> Path:
    """A folder with the converter's own imports (sentencepiece: llama.cpp's Llama converter
    imports it before it looks for a SentencePiece model, even for a BPE tokenizer)."""
    target = cache / "convert-deps"
    if not (target / "sentencepiece").exists():
        subprocess.run(converter_deps_command(target), check=True)
    return target


def convert_to_gguf(model_dir: Path, cache: Path | None = None) -> Path:
    """An f32 GGUF of ``model_dir`` (the same weights pagedserve loads), converted once."""
    cache = cache or cache_dir()
    outfile = cache / "gguf" / f"{model_dir.name}-f32.gguf"
    if outfile.exists():
        return outfile
    source = fetch_source(cache)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(source / "gguf-py"), str(converter_deps(cache))])
    env = dict(os.environ, PYTHONPATH=path)
    subprocess.run(convert_command(source, model_dir, outfile), check=True, env=env)
    return outfile


def quantize_command(binary: Path, source: Path, outfile: Path, qtype: str, threads: int):
    """llama.cpp's own quantizer: its choice of type per tensor (Q4_K_M keeps some rows at
    Q6_K, and falls back to Q5_0 / Q8_0 where a row is not whole 256-weight blocks)."""
    return [str(binary), str(source), str(outfile), qtype, str(threads)]


def quantize_gguf(model_dir: Path, qtype: str, cache: Path | None = None, threads: int = 2):
    """``model_dir`` as a GGUF of ``qtype`` (Q4_K_M, Q8_0, ...), made by llama.cpp from its own
    f32 conversion, once."""
    cache = cache or cache_dir()
    outfile = cache / "gguf" / f"{model_dir.name}-{qtype}.gguf"
    if outfile.exists():
        return outfile
    source = convert_to_gguf(model_dir, cache)
    build_llama_server(cache)
    partial = outfile.with_suffix(".partial")
    command = quantize_command(quantize_binary(cache), source, partial, qtype, threads)
    subprocess.run(command, check=True)
    partial.rename(outfile)  # a quantize cut short never passes for a finished file
    return outfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--convert", default=None, help="also convert this HF folder to GGUF")
    parser.add_argument(
        "--quantize", nargs="*", default=[], help="and quantize it to these types (Q4_K_M ...)"
    )
    args = parser.parse_args(argv)
    if args.quantize and not args.convert:
        parser.error("--quantize quantizes the --convert folder: give --convert FOLDER too")
    print(build_llama_server(jobs=args.jobs))
    if args.convert:
        print(convert_to_gguf(Path(args.convert)))
        for qtype in args.quantize:
            print(quantize_gguf(Path(args.convert), qtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
