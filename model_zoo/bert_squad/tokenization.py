"""WordPiece tokenization as Google BERT does it, reading a standard `vocab.txt`.

`FullTokenizer` = `BasicTokenizer` (clean control characters, optionally lower-case and
strip accents, split on whitespace and punctuation, isolate CJK characters) followed by
`WordpieceTokenizer` (greedy longest-match-first pieces, continuation pieces prefixed
`##`, `[UNK]` for a word that cannot be covered). Outputs match Google's
`tokenization.py`, so a released `vocab.txt` with its checkpoint gives the ids the
checkpoint was trained on. Written here (about a hundred lines) rather than depending on
`tensorflow-text` or a Hugging Face tokenizer for one function.
"""

from __future__ import annotations

import collections
import unicodedata
from pathlib import Path

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def load_vocab(path: str | Path) -> dict[str, int]:
    """`vocab.txt` (one token per line, id = line number) -> {token: id}."""
    vocab: dict[str, int] = collections.OrderedDict()
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            token = line.rstrip("\n").strip()
            if token:
                vocab.setdefault(token, index)
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]") if t not in vocab]
    if missing:
        raise ValueError(f"The vocabulary {path} lacks the special token(s) {missing}.")
    return vocab


class FullTokenizer:
    """Basic + WordPiece tokenization with a vocabulary file."""

    def __init__(self, vocab_file: str | Path, do_lower_case: bool = True):
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.basic = BasicTokenizer(do_lower_case)
        self.wordpiece = WordpieceTokenizer(self.vocab)

    def tokenize(self, text: str) -> list[str]:
        return [
            piece for word in self.basic.tokenize(text) for piece in self.wordpiece.tokenize(word)
        ]

    def convert_tokens_to_ids(self, tokens) -> list[int]:
        return [self.vocab[t] for t in tokens]

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.inv_vocab[i] for i in ids]


class BasicTokenizer:
    """Cleans text and splits it into words and punctuation marks."""

    def __init__(self, do_lower_case: bool = True):
        self.do_lower_case = do_lower_case

    def tokenize(self, text: str) -> list[str]:
        text = _tokenize_cjk(_clean_text(text))
        tokens = []
        for token in text.split():
            if self.do_lower_case:
                token = _strip_accents(token.lower())
            tokens.extend(_split_on_punctuation(token))
        return tokens


class WordpieceTokenizer:
    """Greedy longest-match-first WordPiece over one whitespace-free word."""

    def __init__(self, vocab, unk_token: str = "[UNK]", max_input_chars_per_word: int = 100):
        self.vocab = vocab
        self.unk_token = unk_token
        self.max_input_chars_per_word = max_input_chars_per_word

    def tokenize(self, word: str) -> list[str]:
        if len(word) > self.max_input_chars_per_word:
            return [self.unk_token]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:  # no piece covers word[start]: the whole word is unknown
                return [self.unk_token]
            pieces.append(piece)
            start = end
        return pieces


def is_whitespace(char: str) -> bool:
    """Whitespace as BERT (and the SQuAD reader) sees it."""
    if char in " \t\n\r":
        return True
    return unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    if char in "\t\n\r":
        return False
    return unicodedata.category(char) in ("Cc", "Cf")


def is_punctuation(char: str) -> bool:
    """ASCII non-letters/digits count as punctuation (e.g. '$', '^'), as in BERT."""
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _clean_text(text: str) -> str:
    return "".join(
        " " if is_whitespace(c) else c
        for c in text
        if not (ord(c) in (0, 0xFFFD) or _is_control(c))
    )


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def _tokenize_cjk(text: str) -> str:
    return "".join(f" {c} " if _is_cjk(ord(c)) else c for c in text)


def _strip_accents(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")


def _split_on_punctuation(text: str) -> list[str]:
    words: list[str] = []
    new_word = True
    for char in text:
        if is_punctuation(char):
            words.append(char)
            new_word = True
        else:
            if new_word:
                words.append("")
            words[-1] += char
            new_word = False
    return words
