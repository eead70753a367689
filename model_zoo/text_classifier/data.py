"""The text classifier's data: a built-in topic data set, GLUE-style TSV files, and a
WordPiece vocabulary built from the training text when none is given.

Nothing here is tokenised: the task's preprocessor turns the raw strings into token ids
inside `fit` (epl_trainer/training/pipeline_models.py), as Keras does.
"""

from __future__ import annotations

import collections
import csv
from pathlib import Path

import numpy as np

# Built-in data: a sentence is about one topic. It holds 2-3 words of its topic, filler,
# and sometimes one word of another topic, so a word or two alone does not decide it.
TOPICS = {
    "weather": ["rain", "snow", "wind", "storm", "sunny", "cloudy", "cold", "warm", "fog"],
    "sports": ["match", "goal", "team", "coach", "score", "league", "player", "race", "season"],
    "food": ["soup", "bread", "cheese", "recipe", "spicy", "bake", "dinner", "salad", "sweet"],
}
TOPIC_NAMES = tuple(TOPICS)
FILLER = [
    "the", "a", "today", "was", "very", "we", "saw", "some", "and", "it", "this", "in",
    "town", "people", "said", "more", "than", "ever", "our", "after", "before", "week",
]  # fmt: skip
DISTRACTOR_RATE = 0.4
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def builtin_split(num_samples: int, seed: int) -> tuple[list[str], np.ndarray]:
    """`num_samples` sentences and their topic labels (0..2), the same for a seed."""
    rng = np.random.default_rng(seed)
    texts, labels = [], np.empty(num_samples, dtype="int32")
    for i in range(num_samples):
        label = int(rng.integers(len(TOPIC_NAMES)))
        words = list(rng.choice(TOPICS[TOPIC_NAMES[label]], int(rng.integers(2, 4))))
        if rng.random() < DISTRACTOR_RATE:
            other = TOPIC_NAMES[(label + int(rng.integers(1, len(TOPIC_NAMES)))) % 3]
            words.append(str(rng.choice(TOPICS[other])))
        words += list(rng.choice(FILLER, int(rng.integers(3, 8))))
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels[i] = label
    return texts, labels


def read_tsv(path, text_column: str = "sentence", label_column: str = "label"):
    """(texts, int labels) from a tab-separated file with a header row naming its columns,
    as GLUE's SST-2 `train.tsv` ("sentence<TAB>label"); other columns are ignored.

    Raises:
      ValueError: a missing column, a row without it, a label that is not an int >= 0,
        or no rows; the message names the file and the line.
    """
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None:
            raise ValueError(f"{path}: the file is empty; expected a header row.")
        missing = [c for c in (text_column, label_column) if c not in header]
        if missing:
            raise ValueError(
                f"{path}: the header has no column(s) {missing}. Received header: {header}"
            )
        text_at, label_at = header.index(text_column), header.index(label_column)
        texts, labels = [], []
        for line, row in enumerate(rows, start=2):
            if not row:
                continue  # a blank line
            if len(row) <= max(text_at, label_at):
                raise ValueError(
                    f"{path}, line {line}: {len(row)} field(s), the header has "
                    f"{len(header)}. Received: {row}"
                )
            value = row[label_at].strip()
            if not value.isdigit():
                raise ValueError(
                    f"{path}, line {line}: the label must be an int >= 0. Received: {value!r}"
                )
            texts.append(row[text_at])
            labels.append(int(value))
    if not texts:
        raise ValueError(f"{path}: no rows after the header.")
    return texts, np.asarray(labels, dtype="int32")


def write_tsv(path, texts, labels) -> None:
    """Writes (texts, labels) in the format `read_tsv` reads."""
    lines = ["sentence\tlabel"] + [f"{t}\t{int(y)}" for t, y in zip(texts, labels)]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_vocabulary(texts, path, max_size: int = 30000) -> str:
    """Writes a WordPiece `vocab.txt` of BERT's special tokens and the training text's
    lower-cased words, most frequent first (ties by word), and returns its path.

    Whole words only: the built-in data has a closed vocabulary. For real text, pass a
    pre-trained BERT's vocab.txt (--vocab_file), whose word pieces cover unseen words.
    """
    counts = collections.Counter(word for text in texts for word in text.lower().split())
    words = sorted(counts, key=lambda w: (-counts[w], w))[: max_size - len(SPECIAL_TOKENS)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*SPECIAL_TOKENS, *words]) + "\n", encoding="utf-8")
    return str(path)


def majority_accuracy(train_labels, dev_labels) -> float:
    """The dev accuracy of always answering the training set's most common label."""
    majority = np.bincount(train_labels).argmax()
    return float(np.mean(np.asarray(dev_labels) == majority))
