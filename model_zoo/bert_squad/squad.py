"""SQuAD v1.1: reading the JSON files and featurising examples into BERT windows.

The algorithm is Google BERT's `run_squad.py`: contexts are split on whitespace into
words, words into WordPiece tokens; a question longer than `max_query_length` tokens is
truncated; a context longer than the room left in `max_seq_length` is covered by
overlapping windows starting every `doc_stride` tokens. A training answer that does not
lie wholly inside a window labels that window with position 0 (`[CLS]`). Each window
records, per context token, the original word it came from and whether this window
gives the token its most context, which the answer post-processing needs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from pathlib import Path

import numpy as np

from model_zoo.bert_squad.tokenization import FullTokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SquadExample:
    """One question on one context, with the context split into whitespace words."""

    qas_id: str
    question_text: str
    doc_tokens: list[str]
    answer_texts: list[str]  # every gold answer (one when training)
    start_position: int | None = None  # word index of the first answer, training only
    end_position: int | None = None


@dataclasses.dataclass
class InputFeatures:
    """One window of one example, padded to max_seq_length."""

    unique_id: int
    example_index: int
    doc_span_index: int
    tokens: list[str]
    token_to_orig_map: dict[int, int]  # window position -> word index in the context
    token_is_max_context: dict[int, bool]
    input_ids: list[int]
    input_mask: list[int]
    segment_ids: list[int]
    start_position: int = 0
    end_position: int = 0


def read_squad_json(path: str | Path) -> dict:
    """The parsed file; checks that it is SQuAD-shaped ({"data": [{"paragraphs": ...}]})."""
    dataset = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise ValueError(f'{path} is not a SQuAD file: expected {{"data": [...]}} at the top.')
    return dataset


def examples_from_dataset(dataset: dict, is_training: bool) -> list[SquadExample]:
    """SquadExamples from a parsed SQuAD v1.1 dataset.

    When training, the first answer gives the label span; an answer whose text is not
    found at its `answer_start` is skipped with a warning (as Google's reader does).
    """
    examples = []
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            doc_tokens, char_to_word = _split_words(context)
            for qa in paragraph["qas"]:
                answers = qa.get("answers", [])
                example = SquadExample(
                    qas_id=qa["id"],
                    question_text=qa["question"],
                    doc_tokens=doc_tokens,
                    answer_texts=[a["text"] for a in answers],
                )
                if is_training:
                    if len(answers) != 1:
                        raise ValueError(
                            "Each training question needs exactly one answer. Received: "
                            f"{len(answers)} for question id {qa['id']!r}"
                        )
                    answer = answers[0]
                    start_char = answer["answer_start"]
                    end_char = start_char + len(answer["text"]) - 1
                    if not 0 <= start_char <= end_char < len(context):
                        raise ValueError(
                            f"Answer of question {qa['id']!r} lies outside its context: "
                            f"answer_start={start_char}, length {len(answer['text'])}, "
                            f"context length {len(context)}"
                        )
                    example.start_position = char_to_word[start_char]
                    example.end_position = char_to_word[end_char]
                    found = " ".join(doc_tokens[example.start_position : example.end_position + 1])
                    if " ".join(answer["text"].split()) not in found:
                        logger.warning(
                            "Skipping question %s: answer %r not found at answer_start (%r).",
                            qa["id"],
                            answer["text"],
                            found,
                        )
                        continue
                examples.append(example)
    return examples


def read_squad_examples(path: str | Path, is_training: bool) -> list[SquadExample]:
    """SquadExamples from a SQuAD v1.1 JSON file."""
    return examples_from_dataset(read_squad_json(path), is_training)


# Whitespace as Google's reader sees it (tokenization.is_whitespace): space, tab, newline,
# carriage return and the Unicode category Zs. One regular expression finds the words
# instead of a Python loop over every character (tests/test_bert_squad_data.py checks the
# character class against unicodedata over every code point).
_ZS = "\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000"
WORD = re.compile(f"[^ \t\n\r{_ZS}]+")


def _split_words(text: str) -> tuple[list[str], list[int]]:
    """Whitespace words and, for every character, the index of its word (a space
    belongs to the word before it, -1 before the first word)."""
    words: list[str] = []
    char_to_word: list[int] = []
    for match in WORD.finditer(text):
        start, end = match.span()
        char_to_word += [len(words) - 1] * (start - len(char_to_word))
        words.append(match.group())
        char_to_word += [len(words) - 1] * (end - start)
    char_to_word += [len(words) - 1] * (len(text) - len(char_to_word))
    return words, char_to_word


def convert_examples_to_features(
    examples: list[SquadExample],
    tokenizer: FullTokenizer,
    max_seq_length: int,
    doc_stride: int,
    max_query_length: int,
    is_training: bool,
) -> list[InputFeatures]:
    """Windows of every example (Google's `convert_examples_to_features`)."""
    if doc_stride < 1 or max_query_length < 1:
        raise ValueError(
            "doc_stride and max_query_length must be positive. Received: "
            f"doc_stride={doc_stride}, max_query_length={max_query_length}"
        )
    if max_seq_length - max_query_length - 3 < 1:
        raise ValueError(
            "max_seq_length leaves no room for the context after the question and the "
            f"[CLS]/[SEP] tokens. Received: max_seq_length={max_seq_length}, "
            f"max_query_length={max_query_length}"
        )
    # Contexts are shared by several questions and words repeat: tokenize each word once,
    # and each context once (the examples of a paragraph share its doc_tokens list; the
    # examples keep it alive, so its id is not reused while this runs).
    tokenize = functools.lru_cache(maxsize=None)(tokenizer.tokenize)
    context_pieces = {}
    questions = tokenizer.tokenize_all([example.question_text for example in examples])
    answers = [None] * len(examples)
    if is_training:
        answers = tokenizer.tokenize_all([example.answer_texts[0] for example in examples])
    features = []
    for example_index, example in enumerate(examples):
        query_tokens = questions[example_index][:max_query_length]
        key = id(example.doc_tokens)
        if key not in context_pieces:
            context_pieces[key] = _context_pieces(example.doc_tokens, tokenize)
        doc_pieces, tok_to_orig, orig_to_tok = context_pieces[key]
        answer = None
        if is_training:
            answer = _answer_pieces(example, doc_pieces, orig_to_tok, answers[example_index])
        max_tokens_for_doc = max_seq_length - len(query_tokens) - 3
        spans = doc_spans(len(doc_pieces), max_tokens_for_doc, doc_stride)
        best_span = _max_context_spans(spans, len(doc_pieces))
        for span_index in range(len(spans)):
            feature = _window(
                spans, span_index, best_span, query_tokens, doc_pieces, tok_to_orig, tokenizer
            )
            feature.unique_id = 1000000000 + len(features)
            feature.example_index = example_index
            feature.input_ids += [0] * (max_seq_length - len(feature.input_ids))
            feature.input_mask += [0] * (max_seq_length - len(feature.input_mask))
            feature.segment_ids += [0] * (max_seq_length - len(feature.segment_ids))
            span_start, span_length = spans[span_index]
            if answer and span_start <= answer[0] and answer[1] < span_start + span_length:
                offset = len(query_tokens) + 2 - span_start
                feature.start_position = answer[0] + offset
                feature.end_position = answer[1] + offset
            features.append(feature)
    return features


def _context_pieces(doc_tokens, tokenize):
    """WordPiece tokens of the context words, piece -> word and word -> first piece."""
    pieces, tok_to_orig, orig_to_tok = [], [], []
    for i, word in enumerate(doc_tokens):
        orig_to_tok.append(len(pieces))
        for piece in tokenize(word):
            tok_to_orig.append(i)
            pieces.append(piece)
    return pieces, tok_to_orig, orig_to_tok


def _answer_pieces(example, doc_pieces, orig_to_tok, answer_pieces) -> tuple[int, int]:
    """The training answer's first and last context piece (`answer_pieces`: its text
    tokenized)."""
    start = orig_to_tok[example.start_position]
    last_word = example.end_position + 1
    end = orig_to_tok[last_word] - 1 if last_word < len(orig_to_tok) else len(doc_pieces) - 1
    return _improve_answer_span(doc_pieces, start, end, answer_pieces)


def _window(spans, span_index, best_span, query_tokens, doc_pieces, tok_to_orig, tokenizer):
    """`[CLS] question [SEP] context window [SEP]`, unpadded, with its context maps.
    `best_span[p]`: the window that gives context token p its most context."""
    span_start, span_length = spans[span_index]
    positions = range(span_start, span_start + span_length)
    offset = len(query_tokens) + 2  # the window's first context token
    tokens = ["[CLS]", *query_tokens, "[SEP]", *doc_pieces[span_start : span_start + span_length]]
    tokens.append("[SEP]")
    segment_ids = [0] * offset + [1] * (span_length + 1)
    token_to_orig = {offset + i: tok_to_orig[p] for i, p in enumerate(positions)}
    is_max_context = {offset + i: best_span[p] == span_index for i, p in enumerate(positions)}
    input_ids = tokenizer.convert_tokens_to_ids(tokens)
    return InputFeatures(
        unique_id=0,
        example_index=0,
        doc_span_index=span_index,
        tokens=tokens,
        token_to_orig_map=token_to_orig,
        token_is_max_context=is_max_context,
        input_ids=input_ids,
        input_mask=[1] * len(input_ids),
        segment_ids=segment_ids,
    )


def doc_spans(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) windows of at most `max_tokens`, each `stride` after the last,
    until one reaches the end (one empty window for an empty context)."""
    spans, start = [], 0
    while True:
        length = min(max_tokens, num_tokens - start)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, stride)


def _max_context_spans(spans, num_tokens: int) -> list[int]:
    """For every context token, the span with the most context around it (the min of its
    left and right context, ties to longer spans by a small length bonus; the first such
    span on equal scores): Google's `_check_is_max_context`, computed once per example
    rather than per token and window."""
    if len(spans) == 1:  # one window holds everything (most contexts)
        return [0] * num_tokens
    best_score = [None] * num_tokens
    best_index = [0] * num_tokens
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        for position in range(start, end + 1):
            score = min(position - start, end - position) + 0.01 * length
            if best_score[position] is None or score > best_score[position]:
                best_score[position], best_index[position] = score, index
    return best_index


def _improve_answer_span(doc_pieces, start, end, answer_pieces):
    """The tightest piece span whose text equals the tokenized answer, e.g. "1895" inside
    the word "(1895)"; the word-level span when there is none."""
    target = " ".join(answer_pieces)
    for new_start in range(start, end + 1):
        for new_end in range(end, new_start - 1, -1):
            if " ".join(doc_pieces[new_start : new_end + 1]) == target:
                return new_start, new_end
    return start, end


def features_to_arrays(features: list[InputFeatures], with_labels: bool):
    """({"input_ids", "input_mask", "segment_ids"}, {"start_logits", "end_logits"} labels)."""
    x = {
        name: np.asarray([getattr(f, name) for f in features], dtype="int32")
        for name in ("input_ids", "input_mask", "segment_ids")
    }
    if not with_labels:
        return x, None
    y = {
        "start_logits": np.asarray([f.start_position for f in features], dtype="int32"),
        "end_logits": np.asarray([f.end_position for f in features], dtype="int32"),
    }
    return x, y
