"""Token ids equal transformers.AutoTokenizer's on real text, for each tokenizer format h2o-mini reads.
The tokenizers are trained here, on the GPL-3 text, so the test needs no download."""
import base64
import json

import pytest

from h2o_mini.tokenizer import Tokenizer

from .conftest import GPL3

TEXT = GPL3.read_text()
SAMPLES = [TEXT[:3000], TEXT[20000:23000], "  Leading spaces, tabs\t, digits 12345 and ünïcödé — ok?\n\n"]


def _auto(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


def _bpe(folder):
    from tokenizers import Tokenizer as T, decoders, models, pre_tokenizers, trainers
    tok = T(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from tokenizers import processors
    folder = tmp_path_factory.mktemp("tokjson")
    tok = _bpe(folder)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    import sentencepiece as spm
    folder = tmp_path_factory.mktemp("sp")
    (folder / "corpus.txt").write_text(TEXT)
    spm.SentencePieceTrainer.train(input=str(folder / "corpus.txt"), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=500, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   split_digits=True, allow_whitespace_only_pieces=True)  # as LLaMA 1/2 are
    (folder / "tokenizer.vocab").unlink()
    (folder / "corpus.txt").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return folder


@pytest.fixture(scope="module")
def tiktoken_model(tmp_path_factory):
    """LLaMA 3's format: 'base64(token bytes) rank' lines, ranks in merge order."""
    folder = tmp_path_factory.mktemp("tiktoken")
    tok = _bpe(folder)
    unicode_to_byte = _byte_decoder()
    pieces = sorted(((i, t) for t, i in tok.get_vocab().items() if t not in ("<s>", "</s>")))
    lines = [base64.b64encode(bytes(unicode_to_byte[c] for c in t)).decode() for _, t in pieces]
    (folder / "tokenizer.model").write_text("".join(f"{b} {r}\n" for r, b in enumerate(lines)))
    return folder


def _byte_decoder():
    """GPT-2's byte <-> printable-unicode table, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def test_tokenizer_json_matches_transformers(tokenizer_json):
    ours, theirs = Tokenizer(tokenizer_json), _auto(tokenizer_json)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"] and ids[0] == 0  # BOS from the post-processor
        assert ours.decode(ids) == text


def test_sentencepiece_matches_transformers(sentencepiece_model):
    ours, theirs = Tokenizer(sentencepiece_model), _auto(sentencepiece_model)
    assert ours.kind == "sentencepiece"
    for text in SAMPLES[:2]:
        # sentencepiece adds its dummy-prefix space even before leading whitespace, transformers' Metaspace
        # does not: a text starting with spaces is the one known disagreement; we follow sentencepiece.
        text = text.lstrip()
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"] and ids[0] == 1
        assert ours.decode(ids) == text


def test_tiktoken_matches_transformers(tiktoken_model):
    ours, theirs = Tokenizer(tiktoken_model), _auto(tiktoken_model)
    assert ours.kind == "tiktoken"
    for text in SAMPLES:
        body = ours.encode(text, special=False)
        assert body == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == [ours.token_id("<|begin_of_text|>")] + body
        assert ours.decode(ours.encode(text)) == text
