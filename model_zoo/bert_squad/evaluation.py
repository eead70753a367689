"""Answer extraction from start/end logits, and the official SQuAD v1.1 EM / F1.

`squad_v1_scores` reproduces `evaluate-v1.1.py` (the script SQuAD's leaderboard used):
answers are normalised by lower-casing, removing punctuation, removing the articles
a / an / the and collapsing whitespace; EM and token F1 take the maximum over a
question's gold answers and are averaged over every question of the dataset (a
question without a prediction scores 0), in percent.

`extract_predictions` is Google BERT's `write_predictions`: over every window of an
example, the `n_best_size` highest start and end logits form candidate spans; spans
outside the context, not in the window that gives their start token the most context,
reversed or longer than `max_answer_length` are dropped; the best remaining span is
mapped back to the original context words.
"""

from __future__ import annotations

import collections
import re
import string

import numpy as np

from model_zoo.bert_squad.squad import InputFeatures, SquadExample
from model_zoo.bert_squad.tokenization import BasicTokenizer

_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop articles, collapse whitespace (official order)."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Harmonic mean of token precision and recall over normalised bags of words."""
    prediction_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_v1_scores(dataset: dict, predictions: dict[str, str]) -> dict:
    """{"exact_match", "f1"} in percent over every question of a SQuAD v1.1 dataset."""
    exact = f1 = 0.0
    total = 0
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue  # unanswered: scores 0, as the official script
                truths = [a["text"] for a in qa["answers"]]
                prediction = predictions[qa["id"]]
                exact += max(exact_match_score(prediction, t) for t in truths)
                f1 += max(f1_score(prediction, t) for t in truths)
    if total == 0:
        raise ValueError("The dataset holds no questions to evaluate.")
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def extract_predictions(
    examples: list[SquadExample],
    features: list[InputFeatures],
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    do_lower_case: bool = True,
) -> dict[str, str]:
    """{question id: answer text} from per-window logits ([num_features, seq_length])."""
    by_example = collections.defaultdict(list)
    for index, feature in enumerate(features):
        by_example[feature.example_index].append(index)
    predictions = {}
    for example_index, example in enumerate(examples):
        best = None  # (score, feature index, start, end)
        for index in by_example[example_index]:
            feature = features[index]
            starts = _top_indexes(start_logits[index], n_best_size)
            ends = _top_indexes(end_logits[index], n_best_size)
            for start in starts:
                if start not in feature.token_to_orig_map:
                    continue
                if not feature.token_is_max_context.get(start, False):
                    continue
                for end in ends:
                    if end not in feature.token_to_orig_map or end < start:
                        continue
                    if end - start + 1 > max_answer_length:
                        continue
                    score = start_logits[index][start] + end_logits[index][end]
                    if best is None or score > best[0]:
                        best = (score, index, start, end)
        if best is None:
            predictions[example.qas_id] = ""  # Google's "empty" fallback
            continue
        _, index, start, end = best
        predictions[example.qas_id] = _span_text(
            example, features[index], start, end, do_lower_case
        )
    return predictions


def _top_indexes(logits: np.ndarray, n: int) -> list[int]:
    return [int(i) for i in np.argsort(-np.asarray(logits), kind="stable")[:n]]


def _span_text(example, feature, start, end, do_lower_case) -> str:
    """The original context text of a window span (not the WordPiece text)."""
    pieces = feature.tokens[start : end + 1]
    tok_text = " ".join(pieces).replace(" ##", "").replace("##", "")
    tok_text = " ".join(tok_text.strip().split())
    orig_start = feature.token_to_orig_map[start]
    orig_end = feature.token_to_orig_map[end]
    orig_text = " ".join(example.doc_tokens[orig_start : orig_end + 1])
    return final_text(tok_text, orig_text, do_lower_case)


def final_text(pred_text: str, orig_text: str, do_lower_case: bool) -> str:
    """The part of `orig_text` (whole words) that `pred_text` (normalised tokens) covers.

    The span predicted in WordPiece tokens covers whole original words, which may carry
    extra characters, e.g. "Steve Smith's" for the tokens "steve smith": project the
    token text back onto the original characters by aligning both with spaces removed
    (Google's `get_final_text`); when the alignment fails, the whole words are returned.
    """
    tokenized = " ".join(BasicTokenizer(do_lower_case).tokenize(orig_text))
    position = tokenized.find(pred_text)
    if position == -1:
        return orig_text
    end_position = position + len(pred_text) - 1
    orig_ns, orig_map = _strip_spaces(orig_text)
    tok_ns, tok_map = _strip_spaces(tokenized)
    if len(orig_ns) != len(tok_ns):
        return orig_text
    # tok_map maps positions in the space-free text to the spaced text; invert it.
    ns_of_tok = {tok_index: i for i, tok_index in tok_map.items()}
    if position not in ns_of_tok or end_position not in ns_of_tok:
        return orig_text
    orig_start = orig_map[ns_of_tok[position]]
    orig_end = orig_map[ns_of_tok[end_position]]
    return orig_text[orig_start : orig_end + 1]


def _strip_spaces(text: str) -> tuple[str, dict[int, int]]:
    """The text without spaces, and {index in it: index in `text`}."""
    chars, index_map = [], {}
    for i, char in enumerate(text):
        if char == " ":
            continue
        index_map[len(chars)] = i
        chars.append(char)
    return "".join(chars), index_map
