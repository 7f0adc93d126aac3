"""A `tokenizer.json` from the vocabulary a GGUF file stores in its metadata, giving the token ids that
transformers' own GGUF conversion gives (tests/test_default_model.py, tests/test_gemma3_model.py).

Two kinds are read:

* byte-level BPE (`tokenizer.ggml.model` "gpt2"; SmolLM2): the vocabulary and merges as stored.
* SentencePiece-style BPE (`"llama"` in a Gemma 3 file): the file keeps tokens and scores but no merges. They are
  recovered from the vocabulary: every way of cutting a token into two tokens that are also in the vocabulary
  is a merge, ranked by the token's place in the file (Gemma's scores do not follow its merge order; its file
  order does), then by the longer left half. Spaces become "▁" before BPE runs over the whole text, unknown
  characters fall back to their UTF-8 bytes (`<0x..>` tokens), and whitespace-only tokens, which the file
  spells with real spaces, are spelt with "▁" as the normalised text is.

Control tokens (type 3) become special tokens; user-defined ones (type 4, e.g. Gemma's runs of newlines) are
matched whole in the text, as llama.cpp does.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

CONTROL, USER_DEFINED = 3, 4


def _fields(reader) -> dict:
    f = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    return {"model": f.get("tokenizer.ggml.model"), "tokens": f["tokenizer.ggml.tokens"],
            "types": f["tokenizer.ggml.token_type"], "merges": f.get("tokenizer.ggml.merges"),
            "bos_id": f.get("tokenizer.ggml.bos_token_id"), "eos_id": f.get("tokenizer.ggml.eos_token_id"),
            "unk_id": f.get("tokenizer.ggml.unknown_token_id"),
            "add_bos": bool(f.get("tokenizer.ggml.add_bos_token", False)), "chat_template": f.get("tokenizer.chat_template")}


def write_tokenizer(reader, arch: str, out: Path) -> dict:
    """Write tokenizer.json and tokenizer_config.json for the GGUF's vocabulary into `out`; returns its fields
    (ids of BOS/EOS, the vocabulary size) for config.json."""
    tok = _fields(reader)
    if tok["model"] == "gpt2":
        tokenizer = _byte_level(tok)
    elif tok["model"] == "llama" and arch == "gemma3":
        tokenizer = _gemma(tok)
    else:
        raise UserError(f"GGUF tokenizer {tok['model']!r} of a {arch} model is not supported (byte-level BPE, or "
                        "Gemma's SentencePiece BPE)")
    _specials(tokenizer, tok)
    name = lambda i: tok["tokens"][i] if i is not None else None  # noqa: E731
    if tok["add_bos"] and tok["bos_id"] is not None:
        from tokenizers import processors
        bos = name(tok["bos_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok["bos_id"])])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": name(tok["bos_id"]), "eos_token": name(tok["eos_id"]), "add_bos_token": tok["add_bos"],
              "chat_template": tok["chat_template"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {"bos_id": tok["bos_id"], "eos_id": tok["eos_id"], "vocab_size": len(tok["tokens"])}


def _byte_level(tok: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"] or []]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def gemma_spelling(tokens: list[str]) -> list[str]:
    """The vocabulary as the normalised text spells it: whitespace-only tokens of spaces become runs of "▁"."""
    return ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]


def recovered_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary in merge order: for each token in file order, each cut into two
    tokens of the vocabulary, longer left half first."""
    vocab = set(tokens)
    merges = []
    for token in tokens:
        merges += [(token[:i], token[i:]) for i in range(len(token) - 1, 0, -1)
                   if token[:i] in vocab and token[i:] in vocab]
    return merges


def _gemma(tok: dict):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    tokens = gemma_spelling(tok["tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[tok["unk_id"]] if tok["unk_id"] is not None else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=recovered_merges(tokens), fuse_unk=True, unk_token=unk,
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    # a split on " " after the normaliser removed every space: the whole text is one piece, as in Gemma's own file
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _specials(tokenizer, tok: dict) -> None:
    from tokenizers import AddedToken
    vocab = tokenizer.get_vocab()
    pairs = list(zip(tok["tokens"], tok["types"]))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in pairs if kind == CONTROL])
    user = [AddedToken(t, normalized=False, special=False) for t, kind in pairs if kind == USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens(user)
