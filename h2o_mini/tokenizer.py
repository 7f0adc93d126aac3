"""One small tokenizer wrapper over the three formats checkpoints ship.

* `tokenizer.json`: the `tokenizers` library (its post-processor adds BOS where the checkpoint says so);
* `tokenizer.model`, sentencepiece (LLaMA 1/2): BOS prepended unless `tokenizer_config.json` turns it off;
* `tokenizer.model`, tiktoken ranks (LLaMA 3): `<|begin_of_text|>` prepended, LLaMA 3's split pattern.

BOS/EOS and the chat template come from the checkpoint's own `tokenizer_config.json` / `config.json`.
"""
from __future__ import annotations

import base64
from pathlib import Path

from .errors import UserError
from .files import read_json_object

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        self.chat_template = _chat_template(folder, config)
        self.special = {k: _content(config.get(k), folder, k) for k in ("bos_token", "eos_token")}
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer
            try:
                self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as e:  # tokenizers raises a bare Exception on a malformed file
                raise UserError(f"cannot read {folder / 'tokenizer.json'}: {_first_line(e)}") from None
            self.kind, self._bos = "tokenizers", None  # BOS comes from the post-processor
        elif (folder / "tokenizer.model").is_file():
            try:
                self._load_model_file(folder / "tokenizer.model", config)
            except (OSError, RuntimeError, ValueError, TypeError) as e:
                raise UserError(f"cannot read {folder / 'tokenizer.model'}: {_first_line(e)}") from None
        else:
            raise UserError(f"no tokenizer.json or tokenizer.model in {folder}")

    @property
    def vocab_size(self) -> int:
        """One more than the largest id this tokenizer can produce."""
        if self.kind == "tokenizers":
            return self._tok.get_vocab_size(with_added_tokens=True)
        if self.kind == "tiktoken":
            return self._tok.max_token_value + 1
        return self._tok.get_piece_size()

    def _load_model_file(self, path: Path, config: dict) -> None:
        head = path.read_bytes()[:256]
        if _looks_like_tiktoken(head):
            import tiktoken
            ranks = {base64.b64decode(tok, validate=True): int(rank) for tok, rank in
                     (line.split() for line in path.read_text(encoding="ascii").splitlines() if line.strip())}
            names = LLAMA3_SPECIAL + [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]
            special = {name: len(ranks) + i for i, name in enumerate(names)}
            self._tok = tiktoken.Encoding(name=path.parent.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=special)
            self.kind = "tiktoken"
            self._bos = special["<|begin_of_text|>"] if config.get("add_bos_token", True) else None
            self.special = {"bos_token": "<|begin_of_text|>", "eos_token": self.special["eos_token"] or "<|end_of_text|>"}
            self._special_ids = special
        else:
            import sentencepiece as spm
            self._tok = spm.SentencePieceProcessor(model_file=str(path))
            self.kind = "sentencepiece"
            add_bos = config.get("add_bos_token", True)
            self._bos = self._tok.bos_id() if add_bos and self._tok.bos_id() >= 0 else None

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids as the checkpoint's tokenizer gives them by default (BOS only where it adds one)."""
        if self.kind == "tokenizers":
            return self._tok.encode(text, add_special_tokens=special).ids
        ids = self._tok.encode(text, allowed_special="all") if self.kind == "tiktoken" else self._tok.encode(text)
        return ([self._bos] if special and self._bos is not None else []) + list(ids)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if self.kind == "tokenizers":
            return self._tok.decode(ids, skip_special_tokens=skip_special)
        if self.kind == "tiktoken":
            return self._tok.decode([i for i in ids if not skip_special or i not in self._special_ids.values()])
        return self._tok.decode(ids) if skip_special else "".join(self._tok.id_to_piece(ids))

    def token_id(self, text: str | None) -> int | None:
        if text is None:
            return None
        if self.kind == "tokenizers":
            return self._tok.token_to_id(text)
        if self.kind == "tiktoken":
            return self._special_ids.get(text)
        i = self._tok.piece_to_id(text)
        return None if i == self._tok.unk_id() else i

    def apply_chat_template(self, prompt: str) -> str:
        """The prompt as one user message, rendered by the checkpoint's own chat template."""
        if not self.chat_template:
            raise UserError("this checkpoint has no chat template (tokenizer_config.json: chat_template, or "
                            "chat_template.jinja); drop --chat")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
                bos_token=self.special["bos_token"] or "", eos_token=self.special["eos_token"] or "")
        except TemplateError as e:
            raise UserError(f"the checkpoint's chat template fails: {_first_line(e)}") from None


def _read_json(path: Path) -> dict:
    return read_json_object(path) if path.is_file() else {}


def _chat_template(folder: Path, config: dict) -> str | None:
    """`chat_template.jinja` (how transformers 5 saves it) if present, else tokenizer_config.json's
    `chat_template`: a string, or a list of {name, template} of which "default" is used."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as e:
            raise UserError(f"cannot read {jinja}: {e}") from None
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string")
    return template


def _content(token, folder: Path, key: str) -> str | None:
    value = token.get("content") if isinstance(token, dict) else token
    if value is not None and not isinstance(value, str):
        raise UserError(f"{folder / 'tokenizer_config.json'}: {key} is {token!r}, expected a string")
    return value


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _looks_like_tiktoken(head: bytes) -> bool:
    """A tiktoken ranks file is text lines 'base64 rank'; a sentencepiece model is a binary protobuf."""
    try:
        first = head.decode("ascii").splitlines()[0].split()
        return len(first) == 2 and first[1].isdigit() and bool(base64.b64decode(first[0], validate=True))
    except (UnicodeDecodeError, IndexError, ValueError):
        return False
