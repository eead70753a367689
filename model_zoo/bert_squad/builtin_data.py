"""The built-in dataset: generated SQuAD v1.1 files and their WordPiece vocabulary.

Each paragraph describes one invented town in 5 to 7 facts chosen from the relations
below, in random order ("Dunbelka was founded in 1743. It lies on the Varo river. The
current mayor is Ilsa Tormek. ..."); each question asks for one of the facts with a
template that shares a keyword with it ("Who is the mayor of Dunbelka?"). Names are
made of random syllables, so they cannot be memorised: a model has to find the sentence
the question refers to and copy its span, which is what SQuAD asks of BERT. Two people,
several places and several numbers appear in each paragraph, so answering by type
alone is not enough.

Everything is a function of the seed, so the files are identical on every machine.
Dev questions carry several gold answers (e.g. "Ilsa Tormek" and "Tormek"), as SQuAD's
dev set does. The vocabulary holds BERT's special tokens, the template words,
punctuation, every syllable as a word start and as a `##` continuation, and two-digit
pieces for numbers, so names and years are split into several WordPiece tokens.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from model_zoo.bert_squad.tokenization import SPECIAL_TOKENS


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


SYLLABLES = _words(
    "lem tar zor vi ka mon dri bel sa nor quin rod fe lu gar pim tos ven wil xa yor bra cel "
    "dun ek fal hob ist jun kel mar osk pel ru sil tem ul vor wen"
)
# Not prefixes of syllable strings: WordPiece's greedy match would leave "silk|a" unknown.
THINGS = _words(
    "bridges wine cheese music gardens ships clocks lanterns horses glass lace pottery "
    "bells festivals towers orchards"
)
COLORS = _words("red blue green white black yellow orange purple")

# relation: (context sentence, question templates, dev gold answers given the answer).
RELATIONS = {
    "founded": (
        "{S} was founded in {year}.",
        ("When was {S} founded?", "In which year was {S} founded?"),
    ),
    "founder": (
        "It was founded by {founder}.",
        ("Who founded {S}?", "Who was the founder of {S}?"),
    ),
    "river": (
        "{S} lies on the {river} river.",
        ("Which river does {S} lie on?", "On which river is {S}?"),
    ),
    "population": (
        "About {population} thousand people live there.",
        ("How many thousand people live in {S}?",),
    ),
    "mayor": (
        "The current mayor is {mayor}.",
        ("Who is the mayor of {S}?", "Who is the current mayor of {S}?"),
    ),
    "famous": (
        "The town is famous for its {famous}.",
        ("What is {S} famous for?", "What is {S} known for?"),
    ),
    "flag": (
        "Its flag is {flag}.",
        ("What colors are on the flag of {S}?", "What are the colors of the flag of {S}?"),
    ),
    "capital": ("{S} is the capital of {capital}.", ("Which region is {S} the capital of?",)),
    "twin": ("It is twinned with {twin}.", ("Which town is {S} twinned with?",)),
}
MIN_FACTS, MAX_FACTS = 5, 7
QUESTIONS_PER_PARAGRAPH = 4
FACT_KEY = {"founded": "year"}  # relations whose answer is a fact of another name


def _name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def _facts(rng: random.Random) -> dict[str, str]:
    return {
        "S": _name(rng, rng.randint(2, 3)),
        "year": str(rng.randint(1100, 1999)),
        "founder": f"{_name(rng, 2)} {_name(rng, rng.randint(2, 3))}",
        "river": _name(rng, 2),
        "population": str(rng.randint(10, 99)),
        "mayor": f"{_name(rng, 2)} {_name(rng, rng.randint(2, 3))}",
        "famous": rng.choice(THINGS),
        "flag": " and ".join(rng.sample(COLORS, 2)),
        "capital": _name(rng, rng.randint(2, 3)),
        "twin": _name(rng, rng.randint(2, 3)),
    }


def _gold_answers(relation: str, answer: str, start: int) -> list[tuple[str, int]]:
    """Every acceptable (text, answer_start): the span, plus the variants a human
    annotator might mark (SQuAD's dev set has three annotators per question)."""
    answers = [(answer, start)]
    if relation in ("founder", "mayor"):
        last = answer.split()[-1]
        answers.append((last, start + len(answer) - len(last)))
    elif relation == "river":  # "... lies on the Varo river."
        answers += [(f"the {answer} river", start - 4), (f"{answer} river", start)]
    elif relation == "famous":  # "... famous for its bridges."
        answers.append((f"its {answer}", start - 4))
    return answers


def generate_dataset(num_paragraphs: int, seed: int, with_alternatives: bool) -> dict:
    """A SQuAD v1.1 dataset dict; dev sets (`with_alternatives`) carry several answers."""
    rng = random.Random(seed)
    paragraphs = []
    for p in range(num_paragraphs):
        facts = _facts(rng)
        relations = rng.sample(list(RELATIONS), rng.randint(MIN_FACTS, MAX_FACTS))
        sentences, starts, offset = [], {}, 0
        for relation in relations:
            template = RELATIONS[relation][0]
            key = FACT_KEY.get(relation, relation)
            # The answer's offset: the formatted text before its placeholder.
            starts[relation] = offset + len(template.split("{" + key + "}")[0].format(**facts))
            sentences.append(template.format(**facts))
            offset += len(sentences[-1]) + 1
        context = " ".join(sentences)
        qas = []
        for q, relation in enumerate(rng.sample(relations, QUESTIONS_PER_PARAGRAPH)):
            answer = facts[FACT_KEY.get(relation, relation)]
            answers = [(answer, starts[relation])]
            if with_alternatives:
                answers = _gold_answers(relation, answer, starts[relation])
            for text, start in answers:  # a generator bug must not make a wrong label
                if context[start : start + len(text)] != text:
                    raise AssertionError(f"{text!r} is not at {start} in {context!r}")
            qas.append(
                {
                    "id": f"{seed}-{p}-{q}",
                    "question": rng.choice(RELATIONS[relation][1]).format(**facts),
                    "answers": [{"text": t, "answer_start": s} for t, s in answers],
                }
            )
        paragraphs.append({"context": context, "qas": qas})
    return {"version": "1.1", "data": [{"title": "Invented towns", "paragraphs": paragraphs}]}


def vocabulary() -> list[str]:
    """The vocab.txt lines for the built-in data (ids are line numbers)."""
    words = set()
    for sentence, questions in RELATIONS.values():
        for text in (sentence, *questions):
            words.update(re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", text.lower())))
    words.update(THINGS)
    words.update(COLORS)
    words.add("and")
    tokens = list(SPECIAL_TOKENS)
    tokens += list(".,?'")
    tokens += sorted(words - set(SYLLABLES))
    tokens += [*SYLLABLES, *(f"##{s}" for s in SYLLABLES)]
    tokens += [str(n) for n in range(10, 100)] + [f"##{n:02d}" for n in range(100)]
    return list(dict.fromkeys(tokens))


def write_builtin_data(
    directory: str | Path, num_train_paragraphs: int, num_dev_paragraphs: int, seed: int
) -> dict[str, Path]:
    """Writes train.json, dev.json and vocab.txt; returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {
        "train": directory / "train.json",
        "dev": directory / "dev.json",
        "vocab": directory / "vocab.txt",
    }
    # Different seeds for the two splits: dev towns are not training towns.
    train = generate_dataset(num_train_paragraphs, seed, with_alternatives=False)
    dev = generate_dataset(num_dev_paragraphs, seed + 1_000_003, with_alternatives=True)
    paths["train"].write_text(json.dumps(train) + "\n", encoding="utf-8")
    paths["dev"].write_text(json.dumps(dev) + "\n", encoding="utf-8")
    paths["vocab"].write_text("\n".join(vocabulary()) + "\n", encoding="utf-8")
    return paths
