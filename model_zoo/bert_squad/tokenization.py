"""WordPiece tokenization as Google BERT does it, reading a standard `vocab.txt`.

Built on the `tokenizers` package (Hugging Face's Rust tokenizers): `BertNormalizer`
(drop control characters, map whitespace to spaces, put spaces around CJK characters,
optionally lower-case and strip accents), `BertPreTokenizer` (split on whitespace and
punctuation, where every ASCII non-alphanumeric counts as punctuation), then the
`WordPiece` model (greedy longest-match-first, continuation pieces prefixed `##`,
`[UNK]` for a word it cannot cover or one longer than 100 characters). These are the
steps of Google's `tokenization.py` (`BasicTokenizer` + `WordpieceTokenizer`), so a
released `vocab.txt` with its checkpoint gives the ids the checkpoint was trained on;
tests/test_bert_squad_data.py checks the ids against Google's algorithm.
"""

from __future__ import annotations

import collections
import unicodedata
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
UNK = "[UNK]"
MAX_INPUT_CHARS_PER_WORD = 100  # Google's WordpieceTokenizer default


def load_vocab(path: str | Path) -> dict[str, int]:
    """`vocab.txt` (one token per line, id = line number) -> {token: id}."""
    vocab: dict[str, int] = collections.OrderedDict()
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            token = line.rstrip("\n").strip()
            if token:
                vocab.setdefault(token, index)
    missing = [t for t in (UNK, "[CLS]", "[SEP]") if t not in vocab]
    if missing:
        raise ValueError(f"The vocabulary {path} lacks the special token(s) {missing}.")
    return vocab


class BasicTokenizer:
    """Cleans text and splits it into words and punctuation marks (no vocabulary)."""

    def __init__(self, do_lower_case: bool = True):
        self.do_lower_case = do_lower_case
        self.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, lowercase=do_lower_case
        )
        self.pre_tokenizer = pre_tokenizers.BertPreTokenizer()

    def tokenize(self, text: str) -> list[str]:
        normalized = self.normalizer.normalize_str(text)
        return [word for word, _ in self.pre_tokenizer.pre_tokenize_str(normalized)]


class FullTokenizer:
    """Basic + WordPiece tokenization with a vocabulary file."""

    def __init__(self, vocab_file: str | Path, do_lower_case: bool = True):
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        basic = BasicTokenizer(do_lower_case)
        self._tokenizer = Tokenizer(
            models.WordPiece(
                self.vocab, unk_token=UNK, max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD
            )
        )
        self._tokenizer.normalizer = basic.normalizer
        self._tokenizer.pre_tokenizer = basic.pre_tokenizer

    def tokenize(self, text: str) -> list[str]:
        return self._tokenizer.encode(text, add_special_tokens=False).tokens

    def tokenize_all(self, texts: list[str]) -> list[list[str]]:
        """`tokenize` of each text, in one call (the per-call overhead was a quarter of
        the built-in data's featurisation)."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [encoding.tokens for encoding in encodings]

    def convert_tokens_to_ids(self, tokens) -> list[int]:
        return [self.vocab[t] for t in tokens]

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.inv_vocab[i] for i in ids]


def is_whitespace(char: str) -> bool:
    """Whitespace as BERT (and the SQuAD reader) sees it."""
    if char in " \t\n\r":
        return True
    return unicodedata.category(char) == "Zs"
