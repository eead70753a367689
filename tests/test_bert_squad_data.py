"""BERT-SQuAD data path: tokenizer, SQuAD reading, featurisation, post-processing, EM/F1.

Pure Python (no TensorFlow work): the numbers are hand-computed.
"""

import json
import logging
import unicodedata

import numpy as np
import pytest

from model_zoo.bert_squad import builtin_data, evaluation, squad
from model_zoo.bert_squad.tokenization import BasicTokenizer, FullTokenizer, is_whitespace


def write_vocab(path, tokens):
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *tokens]) + "\n")
    return path


# ---------------------------------------------------------------- tokenization
def test_basic_tokenizer_lowercases_strips_accents_and_splits_punctuation():
    tokenizer = BasicTokenizer(do_lower_case=True)
    assert tokenizer.tokenize(" \tHeLLo!how  \n Are yoU?  ") == [
        "hello",
        "!",
        "how",
        "are",
        "you",
        "?",
    ]
    assert tokenizer.tokenize("Café (1895)") == ["cafe", "(", "1895", ")"]
    assert BasicTokenizer(do_lower_case=False).tokenize("Café") == ["Café"]


def test_wordpiece_is_greedy_longest_match_first_with_unk_fallback(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt", ["want", "##want", "##ed", "un", "runn", "##ing"])
    tokenizer = FullTokenizer(vocab)
    assert tokenizer.tokenize("unwanted") == ["un", "##want", "##ed"]
    assert tokenizer.tokenize("running") == ["runn", "##ing"]
    assert tokenizer.tokenize("unwantedx") == ["[UNK]"]  # one uncovered char: whole word
    assert tokenizer.tokenize("un" * 51) == ["[UNK]"]  # over 100 characters


# Google BERT's tokenization.py (BasicTokenizer + WordpieceTokenizer), condensed: the
# reference the `tokenizers`-based FullTokenizer must reproduce id for id.
def _google_is_punctuation(char):
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _google_is_cjk(cp):
    ranges = [
        (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
    ]  # fmt: skip
    return any(a <= cp <= b for a, b in ranges)


def _google_basic(text, lower):
    def control(c):
        return c not in "\t\n\r" and unicodedata.category(c) in ("Cc", "Cf")

    def space(c):
        return c in " \t\n\r" or unicodedata.category(c) == "Zs"

    text = "".join(
        " " if space(c) else c for c in text if not (ord(c) in (0, 0xFFFD) or control(c))
    )
    text = "".join(f" {c} " if _google_is_cjk(ord(c)) else c for c in text)
    words = []
    for token in text.split():
        if lower:
            token = unicodedata.normalize("NFD", token.lower())
            token = "".join(c for c in token if unicodedata.category(c) != "Mn")
        current = None
        for c in token:
            if _google_is_punctuation(c):
                words.append(c)
                current = None
            else:
                if current is None:
                    words.append("")
                    current = len(words) - 1
                words[current] += c
    return words


def _google_wordpiece(word, vocab):
    if len(word) > 100:
        return ["[UNK]"]
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        if end == start:
            return ["[UNK]"]
        pieces.append(piece)
        start = end
    return pieces


TRICKY_TEXTS = [
    "Café (1895) déjà-vu, naïve RÉSUMÉ!",
    "$5^2 = `25` ~ {x|y} \\ <tag> @home #1 100%",
    "中文字符 and 日本語 mixed",
    "tab\there\nnew\u00a0nbsp\u2003em-space zero\u200bwidth \x00nul \ufffd",
    "don't stop-believing: 1,000.50 e.g. U.S.A.",
    "emoji 🙂 and ligature ﬁ and ü vs u\u0308",
    "x" * 120 + " short",
]


@pytest.mark.parametrize("lower", [True, False])
def test_tokenizer_gives_google_bert_ids(tmp_path, lower):
    """The same ids as Google's tokenization.py: on the built-in data (vocabulary and
    texts), and on text that exercises accents, CJK, control characters, Unicode
    whitespace, ASCII symbols, over-long words and uncased/cased vocabularies."""
    paths = builtin_data.write_builtin_data(tmp_path, 30, 10, seed=5)
    vocab_words = builtin_data.vocabulary()
    extra = ["cafe", "caf", "##e", "de", "##ja", "-", "vu", "na", "##ive", "5", "2", "中", "文",
             "don", "'", "t", "Café", "RÉSUMÉ", "ü", "u", "¨"]  # fmt: skip
    vocab_path = write_vocab(tmp_path / "mixed_vocab.txt", vocab_words[5:] + extra)
    texts = list(TRICKY_TEXTS)
    for name in ("train", "dev"):
        for article in json.loads(paths[name].read_text())["data"]:
            for paragraph in article["paragraphs"]:
                texts.append(paragraph["context"])
                texts += [qa["question"] for qa in paragraph["qas"]]
    tokenizer = FullTokenizer(vocab_path, do_lower_case=lower)
    vocab = tokenizer.vocab
    for text in texts:
        expected = [p for w in _google_basic(text, lower) for p in _google_wordpiece(w, vocab)]
        assert tokenizer.tokenize(text) == expected, text
        assert BasicTokenizer(lower).tokenize(text) == _google_basic(text, lower), text
    assert len(texts) > 150


def test_full_tokenizer_reads_vocab_file_ids_are_line_numbers(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt", ["un", "##aff", "##able", ","])
    tokenizer = FullTokenizer(vocab)
    tokens = tokenizer.tokenize("UNaffable, xyz")
    assert tokens == ["un", "##aff", "##able", ",", "[UNK]"]
    assert tokenizer.convert_tokens_to_ids(tokens) == [5, 6, 7, 8, 1]


def test_vocab_without_special_tokens_is_an_error(tmp_path):
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"lacks the special token\(s\) \['\[UNK\]'"):
        FullTokenizer(tmp_path / "vocab.txt")


# ---------------------------------------------------------------- reading SQuAD files
SQUAD = {
    "version": "1.1",
    "data": [
        {
            "title": "T",
            "paragraphs": [
                {
                    "context": "The club was founded  (1895) in Turin, Italy.",
                    "qas": [
                        {
                            "id": "q1",
                            "question": "When was the club founded?",
                            "answers": [{"text": "1895", "answer_start": 23}],
                        },
                        {
                            "id": "q2",
                            "question": "Where?",
                            "answers": [{"text": "Turin, Italy", "answer_start": 32}],
                        },
                    ],
                }
            ],
        }
    ],
}


def test_reads_a_squad_json_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(SQUAD))
    examples = squad.read_squad_examples(path, is_training=True)
    assert [e.qas_id for e in examples] == ["q1", "q2"]
    first, second = examples
    assert first.doc_tokens == ["The", "club", "was", "founded", "(1895)", "in", "Turin,", "Italy."]
    assert (first.start_position, first.end_position) == (4, 4)  # inside the word "(1895)"
    assert (second.start_position, second.end_position) == (6, 7)
    assert first.answer_texts == ["1895"]


def test_words_split_on_exactly_googles_whitespace():
    """The reader's regular expression splits where Google's per-character test does:
    checked on every Unicode code point, and on text mixing them."""
    differing = [
        hex(code)
        for code in range(0x110000)
        if bool(squad.WORD.fullmatch(chr(code))) == is_whitespace(chr(code))
    ]
    assert not differing
    text = " a\u00a0b\u200bc\t\u3000dé\x0b e "  # U+200B and U+000B are not whitespace there
    words, char_to_word = squad._split_words(text)
    assert words == ["a", "b\u200bc", "dé\x0b", "e"]
    assert char_to_word == [-1, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3]


def test_max_context_spans_follow_googles_per_token_rule():
    """Google's `_check_is_max_context` asks, per token and window, whether no other
    window holding the token scores higher (min of left and right context + 0.01 x
    length; the first window on a tie). Computed once per example here."""

    def google(spans, span_index, position):
        best_score, best_index = None, None
        for index, (start, length) in enumerate(spans):
            end = start + length - 1
            if start <= position <= end:
                score = min(position - start, end - position) + 0.01 * length
                if best_score is None or score > best_score:
                    best_score, best_index = score, index
        return span_index == best_index

    for num_tokens in (0, 1, 9, 10, 11, 37, 100):
        for max_tokens, stride in ((10, 4), (10, 10), (7, 3), (128, 64)):
            spans = squad.doc_spans(num_tokens, max_tokens, stride)
            best = squad._max_context_spans(spans, num_tokens)
            for index, (start, length) in enumerate(spans):
                for position in range(start, start + length):
                    assert (best[position] == index) == google(spans, index, position)


def test_reading_skips_a_training_answer_not_at_its_offset(tmp_path, caplog):
    data = json.loads(json.dumps(SQUAD))
    data["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 4
    path = tmp_path / "train.json"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        examples = squad.read_squad_examples(path, is_training=True)
    assert [e.qas_id for e in examples] == ["q2"]
    assert "Skipping question q1" in caplog.text


def test_a_file_that_is_not_squad_is_an_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a SQuAD file"):
        squad.read_squad_json(path)


# ---------------------------------------------------------------- featurisation
@pytest.fixture
def long_example(tmp_path):
    """One question on a context long enough for several windows."""
    words = [f"w{i}" for i in range(40)]
    vocab = write_vocab(tmp_path / "vocab.txt", [*words, "answer", "is", "(", ")", "?", "what"])
    words[21:23] = ["answer", "(is)"]
    context = " ".join(words)
    start = context.index("answer")
    dataset = {
        "data": [
            {
                "paragraphs": [
                    {
                        "context": context,
                        "qas": [
                            {
                                "id": "q",
                                "question": "what is ?",
                                "answers": [{"text": "answer (is", "answer_start": start}],
                            }
                        ],
                    }
                ]
            }
        ]
    }
    return dataset, FullTokenizer(vocab)


def test_doc_stride_windows_cover_the_context_and_round_trip_the_answer(long_example):
    dataset, tokenizer = long_example
    examples = squad.examples_from_dataset(dataset, is_training=True)
    # 16 - 3 question tokens - 3 specials = 10 context tokens per window, stride 4.
    features = squad.convert_examples_to_features(
        examples, tokenizer, max_seq_length=16, doc_stride=4, max_query_length=8, is_training=True
    )
    doc_tokens = tokenizer.tokenize(" ".join(examples[0].doc_tokens))
    assert len(doc_tokens) == 42  # "(is)" is three tokens
    assert len(features) == 9  # windows start at 0, 4, ..., 32, which reaches the end
    answer = tokenizer.tokenize("answer (is")
    holding = []
    for f in features:
        assert len(f.input_ids) == len(f.input_mask) == len(f.segment_ids) == 16
        assert f.tokens[:5] == ["[CLS]", "what", "is", "?", "[SEP]"]
        if f.start_position:
            holding.append(f.doc_span_index)
            assert f.tokens[f.start_position : f.end_position + 1] == answer
        else:
            assert f.end_position == 0  # the answer is not wholly inside: [CLS]
    # The answer (tokens 21..23: "answer ( is") fits wholly in the windows at 16 and 20.
    assert holding == [4, 5]
    # Every context token has exactly one window that gives it the most context
    # (window k starts at context token 4k; context starts at position 5).
    for position in range(len(doc_tokens)):
        owners = [
            f.doc_span_index
            for f in features
            if f.token_is_max_context.get(5 + position - 4 * f.doc_span_index, False)
        ]
        assert len(owners) == 1, position


def test_improved_answer_span_drops_surrounding_punctuation(tmp_path):
    words = ["the", "club", "was", "founded", "in", "(", ")"]
    words += ["1895", "turin", "italy", ",", ".", "when", "where", "?"]
    tokenizer = FullTokenizer(write_vocab(tmp_path / "vocab.txt", words))
    examples = squad.examples_from_dataset(SQUAD, is_training=True)
    features = squad.convert_examples_to_features(examples, tokenizer, 32, 8, 8, True)
    first = features[0]
    assert first.tokens[first.start_position : first.end_position + 1] == ["1895"]


def test_predictions_map_window_spans_back_to_the_original_text(long_example):
    dataset, tokenizer = long_example
    examples = squad.examples_from_dataset(dataset, is_training=False)
    features = squad.convert_examples_to_features(examples, tokenizer, 16, 4, 8, False)
    train = squad.convert_examples_to_features(
        squad.examples_from_dataset(dataset, is_training=True), tokenizer, 16, 4, 8, True
    )
    start_logits = np.zeros((len(features), 16))
    end_logits = np.zeros((len(features), 16))
    window = train[4]  # the answer's max-context window
    start_logits[4, window.start_position] = 5.0
    end_logits[4, window.end_position] = 5.0
    # A higher-scoring span in a window where it lacks max context must be ignored, as
    # must one in the question.
    start_logits[0, 1] = end_logits[0, 2] = 9.0
    predictions = evaluation.extract_predictions(examples, features, start_logits, end_logits)
    # The span ends inside the word "(is)": the original text is cut at the same char.
    assert predictions == {"q": "answer (is"}


def test_final_text_projects_tokens_onto_original_characters():
    assert evaluation.final_text("steve smith", "Steve Smith's", True) == "Steve Smith"
    assert evaluation.final_text("1895", "(1895)", True) == "1895"
    assert evaluation.final_text("zzz", "(1895)", True) == "(1895)"  # no alignment


def test_bad_window_sizes_are_errors_naming_the_values(long_example):
    dataset, tokenizer = long_example
    examples = squad.examples_from_dataset(dataset, is_training=False)
    with pytest.raises(ValueError, match="max_seq_length=10, max_query_length=8"):
        squad.convert_examples_to_features(examples, tokenizer, 10, 4, 8, False)
    with pytest.raises(ValueError, match="doc_stride=0"):
        squad.convert_examples_to_features(examples, tokenizer, 32, 0, 8, False)


# ---------------------------------------------------------------- official EM / F1
def squad_dataset(answers_by_id):
    qas = [
        {"id": qid, "question": "?", "answers": [{"text": t, "answer_start": 0} for t in texts]}
        for qid, texts in answers_by_id.items()
    ]
    return {"data": [{"paragraphs": [{"context": "", "qas": qas}]}]}


def test_normalisation_is_the_official_one():
    assert evaluation.normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert evaluation.normalize_answer("An apple a day") == "apple day"
    assert evaluation.normalize_answer("banana theatre") == "banana theatre"  # whole words only


def test_em_and_f1_match_hand_computed_values():
    dataset = squad_dataset(
        {
            "articles": ["the Eiffel Tower"],
            "several": ["Denver Broncos", "Broncos"],
            "partial": ["Santa Clara, California"],
            "missing": ["1895"],
            "an": ["an apple a day"],
        }
    )
    predictions = {
        "articles": "Eiffel tower.",  # case, article, punctuation: exact
        "several": "The Broncos",  # matches the second gold answer
        "partial": "Clara California USA",  # 2 of 3 tokens each way: F1 2/3
        "an": "apple day",
    }
    scores = evaluation.squad_v1_scores(dataset, predictions)
    assert scores["exact_match"] == pytest.approx(100 * 3 / 5)
    assert scores["f1"] == pytest.approx(100 * (1 + 1 + 2 / 3 + 0 + 1) / 5)


def test_f1_takes_the_best_gold_answer_and_counts_repeated_tokens():
    assert evaluation.f1_score("x b b", "b b c") == pytest.approx(2 / 3)  # 2 common of 3
    assert evaluation.f1_score("a b b", "b b c") == pytest.approx(0.8)  # "a" is an article
    dataset = squad_dataset({"q": ["red", "red and green"]})
    scores = evaluation.squad_v1_scores(dataset, {"q": "green and red"})
    # vs "red": P 1/3, R 1 -> 0.5; vs "red and green": P = R = 1 -> F1 1 (EM 0).
    assert scores == {"exact_match": 0.0, "f1": 100.0}


# ---------------------------------------------------------------- built-in data
def test_builtin_data_is_deterministic_valid_and_fully_in_vocabulary(tmp_path):
    first = builtin_data.write_builtin_data(tmp_path / "a", 30, 10, seed=3)
    second = builtin_data.write_builtin_data(tmp_path / "b", 30, 10, seed=3)
    for name in ("train", "dev", "vocab"):
        assert first[name].read_text() == second[name].read_text()
    tokenizer = FullTokenizer(first["vocab"])
    dev = squad.read_squad_json(first["dev"])
    for paragraph in dev["data"][0]["paragraphs"]:
        context = paragraph["context"]
        assert "[UNK]" not in tokenizer.tokenize(context)
        for qa in paragraph["qas"]:
            for answer in qa["answers"]:
                start = answer["answer_start"]
                assert context[start : start + len(answer["text"])] == answer["text"]
    assert any(len(qa["answers"]) > 1 for p in dev["data"][0]["paragraphs"] for qa in p["qas"])
    train = squad.read_squad_examples(first["train"], is_training=True)
    assert len(train) == 30 * builtin_data.QUESTIONS_PER_PARAGRAPH  # none skipped
