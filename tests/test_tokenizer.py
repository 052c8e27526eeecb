"""Tokenizer interface over tokenizer.json and tokenizer.model; incremental detokenization."""

from __future__ import annotations

import io
import json
import random

import pytest

from jhybrid.tokenizer import REPLACEMENT_CHAR, HFTokenizer, IncrementalDetokenizer, SentencePieceTokenizer, load_tokenizer

WORDS = "the quick brown fox jumps over lazy dog café naïve 東京 hello world, ünïcode".split()
TEXTS = ["hello world", "the café in 東京 😀 is naïve", "emoji 🤖🎉 then text", "  leading and trailing  ", "a\nb"]


def _corpus(n=300, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """Byte-level BPE (every byte is a token, so emoji split over several ids) with a BOS template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|bos|>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    path = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(path / "tokenizer.json"))
    json.dump({"bos_token": {"content": "<|bos|>"}, "eos_token": "<|im_end|>"}, open(path / "tokenizer_config.json", "w"))
    json.dump({"eos_token_id": [2, 0]}, open(path / "generation_config.json", "w"))
    return path


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """sentencepiece BPE with byte fallback, trained in memory."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=320, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp_tok")
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    return path


def test_load_tokenizer_picks_implementation(hf_dir, sp_dir, tmp_path):
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)
    assert isinstance(load_tokenizer(sp_dir), SentencePieceTokenizer)
    assert load_tokenizer(tmp_path) is None


def test_hf_tokenizer(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2, 0)  # tokenizer_config eos first, then generation_config's, deduplicated
    assert tok.eos_token_id == 2
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1 and 1 not in tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text
    assert tok.vocab_size >= 256


def test_sentencepiece_tokenizer(sp_dir, tmp_path):
    tok = load_tokenizer(sp_dir)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    for text in ["hello world", "the café in 東京 😀 is naïve"]:
        ids = tok.encode(text)
        assert ids[0] == 1 and ids[1:] == tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode(ids + [2], skip_special_tokens=False) == "<s>" + text + "</s>"
    # tokenizer_config.json can switch BOS off and EOS on
    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    json.dump({"add_bos_token": False, "add_eos_token": True}, open(tmp_path / "tokenizer_config.json", "w"))
    tok2 = load_tokenizer(tmp_path)
    ids = tok2.encode("hello")
    assert ids[0] != 1 and ids[-1] == 2


def _stream(tok, ids, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("which", ["hf", "sp"])
@pytest.mark.parametrize("text", TEXTS + [" ".join(_corpus(5, seed=1)) + " 😀🤖 end"])
def test_incremental_detokenizer_matches_full_decode(hf_dir, sp_dir, which, text):
    tok = load_tokenizer(hf_dir if which == "hf" else sp_dir)
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert deltas[-1] == ""  # nothing held back at the end of a complete text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)  # never a half character


@pytest.mark.parametrize("which", ["hf", "sp"])
def test_incremental_detokenizer_holds_split_utf8(hf_dir, sp_dir, which):
    tok = load_tokenizer(hf_dir if which == "hf" else sp_dir)
    prompt = tok.encode("hello", add_special_tokens=False)
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) >= 4  # the emoji is 4 byte tokens (no merges for it in the tiny vocabularies)
    detok, deltas = _stream(tok, ids, prompt_ids=prompt)
    assert deltas[-5:] == ["", "", "", "😀", ""]  # held until its last byte arrives; flush adds nothing
    assert "".join(deltas) == " 😀"
    # an unfinished character is emitted (as U+FFFD) only by flush()
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert REPLACEMENT_CHAR not in detok.add_many(ids[:-1])
    assert detok.flush().endswith(REPLACEMENT_CHAR)


def test_incremental_detokenizer_special_tokens(hf_dir):
    tok = load_tokenizer(hf_dir)
    ids = tok.encode("hello world") + [2]
    _, deltas = _stream(tok, ids)
    assert "".join(deltas) == "hello world"
    _, deltas = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "<|bos|>hello world<|im_end|>"
