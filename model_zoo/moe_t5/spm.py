"""T5's tokenisation: a SentencePiece model (`--spm_model`), read by the `sentencepiece`
package, with the interface of `data.Vocabulary` (encode / decode / encode_tf / len).

T5's SentencePiece models reserve id 0 for padding, 1 for `</s>` and 2 for `<unk>` and
have no `<s>`; the model zoo's data pipeline relies on those ids, so a model trained
with other ids is refused with the ids it has. Train one that fits with
`spm.SentencePieceTrainer.train(..., pad_id=0, eos_id=1, unk_id=2, bos_id=-1)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sentencepiece as spm
import tensorflow as tf

from model_zoo.moe_t5.data import EOS_ID, PAD_ID, UNK_ID

T5_SPECIAL_IDS = {"pad": PAD_ID, "eos": EOS_ID, "unk": UNK_ID}


class SentencePieceVocabulary:
    """A SentencePiece model as a vocabulary of the MoE-T5 data pipeline."""

    def __init__(self, model_path: str):
        with tf.io.gfile.GFile(model_path, "rb") as f:
            proto = f.read()
        self.path = model_path
        self._processor = spm.SentencePieceProcessor(model_proto=proto)
        found = {
            "pad": self._processor.pad_id(),
            "eos": self._processor.eos_id(),
            "unk": self._processor.unk_id(),
        }
        if found != T5_SPECIAL_IDS:
            raise ValueError(
                f"The SentencePiece model {model_path!r} must use T5's special ids "
                f"{T5_SPECIAL_IDS}. Received: {found} (train it with pad_id=0, eos_id=1, "
                "unk_id=2, bos_id=-1)"
            )

    def __len__(self) -> int:
        return self._processor.get_piece_size()

    def encode(self, text: str, max_length: int) -> np.ndarray:
        """`[max_length]` int32: the pieces' ids, truncated to leave room for `</s>`."""
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2. Received: {max_length!r}")
        ids = [*self._processor.encode(text)[: max_length - 1], EOS_ID]
        return np.array(ids + [PAD_ID] * (max_length - len(ids)), dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first `</s>`; padding is skipped."""
        kept = []
        for i in (int(i) for i in ids):
            if i == EOS_ID:
                break
            if i != PAD_ID:
                kept.append(i)
        return self._processor.decode(kept)

    def encode_tf(self, text: tf.Tensor, max_length: int) -> tf.Tensor:
        """`encode` inside a tf.data map, for one scalar string."""

        def encode(value):  # a 0-d bytes array, or bytes
            raw = value.item() if isinstance(value, np.ndarray) else value
            return self.encode(raw.decode("utf-8"), max_length)

        ids = tf.numpy_function(encode, [text], tf.int32, stateful=False)
        return tf.ensure_shape(ids, [max_length])
