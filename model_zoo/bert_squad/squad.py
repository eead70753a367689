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
from pathlib import Path

import numpy as np

from model_zoo.bert_squad.tokenization import FullTokenizer, is_whitespace

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


def _split_words(text: str) -> tuple[list[str], list[int]]:
    """Whitespace words and, for every character, the index of its word."""
    words: list[str] = []
    char_to_word: list[int] = []
    previous_is_space = True
    for char in text:
        if is_whitespace(char):
            previous_is_space = True
        else:
            if previous_is_space:
                words.append(char)
            else:
                words[-1] += char
            previous_is_space = False
        char_to_word.append(len(words) - 1)
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
    # Contexts are shared by several questions and words repeat: tokenize each word once.
    tokenize = functools.lru_cache(maxsize=None)(tokenizer.tokenize)
    features = []
    for example_index, example in enumerate(examples):
        query_tokens = tokenizer.tokenize(example.question_text)[:max_query_length]
        doc_pieces, tok_to_orig, orig_to_tok = _context_pieces(example.doc_tokens, tokenize)
        answer = None
        if is_training:
            answer = _answer_pieces(example, doc_pieces, orig_to_tok, tokenizer)
        max_tokens_for_doc = max_seq_length - len(query_tokens) - 3
        spans = doc_spans(len(doc_pieces), max_tokens_for_doc, doc_stride)
        for span_index in range(len(spans)):
            feature = _window(spans, span_index, query_tokens, doc_pieces, tok_to_orig, tokenizer)
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


def _answer_pieces(example, doc_pieces, orig_to_tok, tokenizer) -> tuple[int, int]:
    """The training answer's first and last context piece."""
    start = orig_to_tok[example.start_position]
    last_word = example.end_position + 1
    end = orig_to_tok[last_word] - 1 if last_word < len(orig_to_tok) else len(doc_pieces) - 1
    return _improve_answer_span(doc_pieces, start, end, tokenizer, example.answer_texts[0])


def _window(spans, span_index, query_tokens, doc_pieces, tok_to_orig, tokenizer):
    """`[CLS] question [SEP] context window [SEP]`, unpadded, with its context maps."""
    span_start, span_length = spans[span_index]
    tokens = ["[CLS]", *query_tokens, "[SEP]"]
    segment_ids = [0] * len(tokens)
    token_to_orig, is_max_context = {}, {}
    for position in range(span_start, span_start + span_length):
        token_to_orig[len(tokens)] = tok_to_orig[position]
        is_max_context[len(tokens)] = _is_max_context(spans, span_index, position)
        tokens.append(doc_pieces[position])
        segment_ids.append(1)
    tokens.append("[SEP]")
    segment_ids.append(1)
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


def _is_max_context(spans, span_index: int, position: int) -> bool:
    """Whether span `span_index` has the most context (min of left/right, ties to shorter
    spans by a small length bonus) around token `position` among the spans holding it."""
    best_score, best_index = None, None
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        if not start <= position <= end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best_index = score, index
    return span_index == best_index


def _improve_answer_span(doc_pieces, start, end, tokenizer, answer_text):
    """The tightest piece span whose text equals the tokenized answer, e.g. "1895" inside
    the word "(1895)"; the word-level span when there is none."""
    target = " ".join(tokenizer.tokenize(answer_text))
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
