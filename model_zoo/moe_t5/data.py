"""Data for the MoE-T5 recipe: a vocabulary, a generated task, and TSV / TFRecord readers.

Every example becomes fixed-length int32 arrays (static shapes keep the MoE layer's
token count known, so its capacity is a Python int):

* `encoder_tokens [max_source_length]`: the source ids, then `</s>`, then `<pad>`s;
* `decoder_tokens [max_target_length]`: teacher forcing, the targets shifted right by
  one with `<pad>` as the start token (T5's convention);
* labels `[max_target_length]`: the target ids, then `</s>`, then `<pad>`s. Pad
  positions are masked out of the loss and the token accuracy.

Text is tokenised by whitespace against a vocabulary file (one token per line). The
same encoding is available in Python (`Vocabulary.encode`, for generated data and
decoding) and as TensorFlow ops (`Vocabulary.encode_tf`, inside `tf.data`); the tests
check that they agree. (SentencePiece models are not supported: the package is not a
dependency of this project.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import tensorflow as tf

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
SPECIAL_TOKENS = (PAD, EOS, UNK)  # ids 0, 1, 2 as in T5's SentencePiece vocabulary

# The generated task: reverse a sequence of symbols and map each one through a fixed
# substitution (a -> A ...). Learning it needs both attention alignment (position
# n-1-i of the source feeds target position i, for every length n) and a token mapping.
TASK_SYMBOLS = tuple("abcdefghijklmnop")
TASK_MIN_LENGTH, TASK_MAX_LENGTH = 3, 10


class Vocabulary:
    """Whitespace tokens <-> ids; `<pad>`, `</s>`, `<unk>` always take ids 0, 1, 2.

    Args:
      tokens: the other tokens, in id order from 3 (the special tokens may appear in
        this list too, at any place: they keep ids 0-2 and are not repeated).
    """

    def __init__(self, tokens: Iterable[str]):
        ordered = list(SPECIAL_TOKENS)
        seen = set(ordered)
        for token in tokens:
            if not token or any(c.isspace() for c in token):
                raise ValueError(
                    "Vocabulary tokens must be non-empty and contain no whitespace (text is "
                    f"split on whitespace). Received: {token!r}"
                )
            if token in seen:
                if token in SPECIAL_TOKENS:
                    continue
                raise ValueError(f"Duplicate vocabulary token {token!r}.")
            seen.add(token)
            ordered.append(token)
        self.tokens = tuple(ordered)
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self._table = None

    @classmethod
    def from_file(cls, path: str) -> Vocabulary:
        """Reads one token per line (UTF-8); blank lines are skipped."""
        with tf.io.gfile.GFile(path) as f:
            lines = [line.strip() for line in f]
        tokens = [line for line in lines if line]
        if not tokens:
            raise ValueError(f"The vocabulary file {path!r} holds no tokens.")
        try:
            return cls(tokens)
        except ValueError as e:
            raise ValueError(f"{e} (in vocabulary file {path!r})") from None

    def write(self, path: str) -> None:
        """Writes the vocabulary as a file `from_file` reads back with the same ids."""
        with tf.io.gfile.GFile(path, "w") as f:
            f.write("\n".join(self.tokens) + "\n")

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, max_length: int) -> np.ndarray:
        """`[max_length]` int32: ids of the whitespace tokens (unknown -> `<unk>`),
        truncated to leave room for `</s>`, then `</s>` and `<pad>`s."""
        _check_length(max_length)
        ids = [self._ids.get(token, UNK_ID) for token in text.split()][: max_length - 1]
        ids.append(EOS_ID)
        return np.array(ids + [PAD_ID] * (max_length - len(ids)), dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first `</s>`; `<pad>`s are skipped."""
        words = []
        for i in (int(i) for i in ids):
            if i == EOS_ID:
                break
            if i != PAD_ID:
                words.append(self.tokens[i] if 0 <= i < len(self.tokens) else UNK)
        return " ".join(words)

    def encode_tf(self, text: tf.Tensor, max_length: int) -> tf.Tensor:
        """`encode` as TensorFlow ops for one scalar string: `[max_length]` int32."""
        _check_length(max_length)
        if self._table is None:
            # Created on first use (a Vocabulary stays cheap outside TF), eagerly: the
            # first use is usually inside a tf.data map function, and a table made in
            # that graph could not be used by the next dataset's.
            with tf.init_scope():
                self._table = self._lookup_table()
        words = tf.strings.split(tf.strings.strip(text))
        ids = tf.cast(self._table.lookup(words), tf.int32)[: max_length - 1]
        ids = tf.concat([ids, [EOS_ID]], axis=0)
        ids = tf.pad(ids, [[0, max_length - tf.shape(ids)[0]]], constant_values=PAD_ID)
        return tf.ensure_shape(ids, [max_length])

    def _lookup_table(self) -> tf.lookup.StaticHashTable:
        return tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(self.tokens), tf.range(len(self.tokens), dtype=tf.int64)
            ),
            default_value=UNK_ID,
        )


def _check_length(max_length: int) -> None:
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(
            "A maximum length must be an int >= 2 (at least one token and </s>). "
            f"Received: {max_length!r}"
        )


def shift_right(labels):
    """Decoder inputs for teacher forcing: `<pad>` (the start token), then labels[:-1]."""
    if isinstance(labels, np.ndarray):
        start = np.full((*labels.shape[:-1], 1), PAD_ID, labels.dtype)
        return np.concatenate([start, labels[..., :-1]], axis=-1)
    start = tf.fill(tf.concat([tf.shape(labels)[:-1], [1]], 0), tf.constant(PAD_ID, labels.dtype))
    return tf.concat([start, labels[..., :-1]], axis=-1)


def features_and_labels(source_ids, target_ids):
    """({"encoder_tokens", "decoder_tokens"}, labels) from encoded source and target."""
    return {"encoder_tokens": source_ids, "decoder_tokens": shift_right(target_ids)}, target_ids


# ---- the generated task --------------------------------------------------------------------


def task_vocabulary() -> Vocabulary:
    """The generated task's vocabulary: the source symbols and their upper-case images."""
    return Vocabulary(list(TASK_SYMBOLS) + [s.upper() for s in TASK_SYMBOLS])


def task_pairs(num_examples: int, seed: int) -> list[tuple[str, str]]:
    """(source, target) text pairs: "c a f" -> "F A C" (reversed, then mapped)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(num_examples):
        length = int(rng.integers(TASK_MIN_LENGTH, TASK_MAX_LENGTH + 1))
        source = [TASK_SYMBOLS[i] for i in rng.integers(0, len(TASK_SYMBOLS), length)]
        pairs.append((" ".join(source), " ".join(s.upper() for s in reversed(source))))
    return pairs


def encode_pairs(pairs, vocab: Vocabulary, max_source_length: int, max_target_length: int):
    """Numpy (features, labels) for text pairs, ready for `EPLTrainer.fit`."""
    source = np.stack([vocab.encode(s, max_source_length) for s, _ in pairs])
    target = np.stack([vocab.encode(t, max_target_length) for _, t in pairs])
    return features_and_labels(source, target)


# ---- files ---------------------------------------------------------------------------------

TFRECORD_SOURCE_KEY, TFRECORD_TARGET_KEY = "source", "target"
FORMATS = ("tsv", "tfrecord")


def infer_format(files: Sequence[str]) -> str:
    """ "tfrecord" for `.tfrecord*` / `.tfr*` names, "tsv" for `.tsv` / `.txt`."""
    kinds = set()
    for name in files:
        base = os.path.basename(name).lower()
        if ".tfrecord" in base or ".tfr" in base:
            kinds.add("tfrecord")
        elif base.endswith((".tsv", ".txt")) or ".tsv" in base:
            kinds.add("tsv")
        else:
            kinds.add(None)
    if len(kinds) != 1 or None in kinds:
        raise ValueError(
            "Cannot tell the data format from the file names (expected all .tsv/.txt or all "
            f".tfrecord); pass --data_format=tsv or tfrecord. Received: {list(files)[:5]}"
        )
    return kinds.pop()


def parse_fn_for(data_format: str, vocab: Vocabulary, max_source_length: int, max_target_length):
    """`record -> (features, labels)` for one TSV line or one serialized tf.train.Example.

    TSV lines are `source<TAB>target`. TFRecord examples hold the texts as bytes
    features `source` and `target`.
    """
    if data_format not in FORMATS:
        raise ValueError(f"data_format must be one of {FORMATS}. Received: {data_format!r}")

    def texts(record):
        if data_format == "tfrecord":
            spec = {
                TFRECORD_SOURCE_KEY: tf.io.FixedLenFeature([], tf.string),
                TFRECORD_TARGET_KEY: tf.io.FixedLenFeature([], tf.string),
            }
            example = tf.io.parse_single_example(record, spec)
            return example[TFRECORD_SOURCE_KEY], example[TFRECORD_TARGET_KEY]
        fields = tf.strings.split(record, "\t")
        check = tf.debugging.Assert(
            tf.equal(tf.size(fields), 2),
            ["A TSV line must be source<TAB>target. Received:", record],
        )
        with tf.control_dependencies([check]):
            return tf.identity(fields[0]), tf.identity(fields[-1])

    def parse(record):
        source, target = texts(record)
        return features_and_labels(
            vocab.encode_tf(source, max_source_length), vocab.encode_tf(target, max_target_length)
        )

    return parse


def records(files: Sequence[str], data_format: str) -> tf.data.Dataset:
    """The raw records of `files`: TSV lines (blank lines skipped) or TFRecords."""
    if data_format == "tfrecord":
        return tf.data.TFRecordDataset(list(files))
    if data_format == "tsv":
        lines = tf.data.TextLineDataset(list(files))
        return lines.filter(lambda line: tf.strings.length(tf.strings.strip(line)) > 0)
    raise ValueError(f"data_format must be one of {FORMATS}. Received: {data_format!r}")


def read_files(
    files: Sequence[str],
    data_format: str,
    vocab: Vocabulary,
    max_source_length: int,
    max_target_length: int,
) -> tf.data.Dataset:
    """Unbatched (features, labels) examples from `files`, in file order."""
    parse = parse_fn_for(data_format, vocab, max_source_length, max_target_length)
    return records(files, data_format).map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def write_tsv(path: str, pairs: Iterable[tuple[str, str]]) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        for source, target in pairs:
            f.write(f"{source}\t{target}\n")


def write_tfrecord(path: str, pairs: Iterable[tuple[str, str]]) -> None:
    def feature(text):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[text.encode("utf-8")]))

    with tf.io.TFRecordWriter(path) as writer:
        for source, target in pairs:
            fields = {TFRECORD_SOURCE_KEY: feature(source), TFRECORD_TARGET_KEY: feature(target)}
            example = tf.train.Example(features=tf.train.Features(feature=fields))
            writer.write(example.SerializeToString())
