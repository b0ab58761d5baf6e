"""Tiny random-weight pooling checkpoints, for tests and tutorials: BERT and XLM-RoBERTa
embedders (with sentence-transformers' pooling files), a BERT cross-encoder, a decoder
classifier. Built from transformers' own config and model classes (no download) with a small
WordPiece tokenizer trained on the spot, so transformers can run the same weights as the
reference. A decoder embedder is a generative checkpoint (testing.make_tiny_checkpoint) served
with ``convert="embed"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.models.testing import _CORPUS, TINY_VOCAB, build_tiny_tokenizer

TINY_POOLING_ARCHS = ("bert", "xlm_roberta", "bert_cross_encoder", "llama_classifier")
_PAIRS = ["What is paged attention?", "Which block holds the prefix?", "Is the cache full?"]


def build_tiny_wordpiece_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A lower-casing WordPiece tokenizer as BERT's: [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3
    [MASK]=4; a pair is ``[CLS] a [SEP] b [SEP]`` with token types 0 then 1."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False
    )
    tok.train_from_iterator((_CORPUS + _PAIRS) * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )  # fmt: skip
    fast.save_pretrained(out_dir)


def _encoder_config(arch: str, overrides: dict[str, Any]):
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, initializer_range=0.1,
        pad_token_id=0,
    )  # fmt: skip
    if arch in ("bert", "bert_cross_encoder"):
        cls = transformers.BertConfig
    else:
        cls, common["type_vocab_size"] = transformers.XLMRobertaConfig, 1
    if arch == "bert_cross_encoder":
        common["num_labels"] = 1
    common.update(overrides)
    return cls(**common)


def write_sentence_transformers_files(
    out_dir: Path, dim: int, pooling: str = "mean", normalize: bool = True
) -> None:
    """modules.json, 1_Pooling/config.json (and a Normalize module) as sentence-transformers
    saves them, so both it and pagedserve read the same pooling."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    flags = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
    config = {"word_embedding_dimension": dim, **{flag: False for flag in flags.values()}}
    config[flags[pooling]] = True
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 96}))


def make_tiny_pooling_checkpoint(
    arch: str, out_dir: str | Path, seed: int = 0, pooling: str = "mean", **overrides: Any
) -> Path:
    """Write a random-weight pooling ``arch`` checkpoint (+ tokenizer) to ``out_dir``.

    ``bert`` / ``xlm_roberta``: an embedder with sentence-transformers files (``pooling``:
    mean or cls, normalised); ``bert_cross_encoder``: BertForSequenceClassification with one
    label; ``llama_classifier``: LlamaForSequenceClassification with three labels."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    torch.manual_seed(seed)
    if arch == "llama_classifier":
        from pagedserve.models.testing import _llama_family_config

        config = _llama_family_config("llama", dict(num_labels=3, pad_token_id=0, **overrides))
        model = transformers.LlamaForSequenceClassification(config)
        model.save_pretrained(out_dir, safe_serialization=True)
        build_tiny_tokenizer(out_dir, config.vocab_size)
        return out_dir
    if arch not in TINY_POOLING_ARCHS:
        raise ValueError(f"unknown tiny pooling architecture {arch!r}: {TINY_POOLING_ARCHS}")
    config = _encoder_config(arch, overrides)
    if arch == "bert_cross_encoder":
        model = transformers.BertForSequenceClassification(config)
    elif arch == "bert":
        model = transformers.BertModel(config, add_pooling_layer=False)
    else:
        model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_wordpiece_tokenizer(out_dir, config.vocab_size)
    if arch in ("bert", "xlm_roberta"):
        write_sentence_transformers_files(out_dir, config.hidden_size, pooling)
    return out_dir


_WORDS = (
    "the a model server request block cache token prefix attention batch step query document "
    "embedding vector search river mountain city music coffee morning quickly slowly bright "
    "ancient quiet 42 2024 3.14 über café naïve 東京 données réseau fast slow green blue why "
    "how when paged kernel GPU CPU memory latency throughput sentence meaning similar"
).split()
_SHAPES = ("{}.", "{}?", "{}!", "“{}”", "{} — {}.", "{}, {}; {}.", "{}: {}")


def sentence_corpus(count: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """``count`` varied sentences (1 to ``max_words`` words, mostly short as real queries
    and titles are, some long; punctuation, numbers, accents, CJK), the same for a seed: the
    workload of the embedding tests and of tools/bench_embeddings.py."""
    import random

    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        length = min(max_words, max(1, int(rng.lognormvariate(2.3, 0.8))))
        words = [rng.choice(_WORDS) for _ in range(length)]
        shape = rng.choice(_SHAPES)
        parts = shape.count("{}")
        cuts = (
            sorted(rng.sample(range(1, length), min(parts - 1, length - 1))) if length > 1 else []
        )
        pieces = [" ".join(words[a:b]) for a, b in zip([0, *cuts], [*cuts, length])]
        pieces += [rng.choice(_WORDS)] * (parts - len(pieces))
        text = shape.format(*pieces)
        sentences.append(text[0].upper() + text[1:] if rng.random() < 0.7 else text)
    return sentences
