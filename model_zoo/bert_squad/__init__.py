"""BERT fine-tuned for SQuAD v1.1 on EPLTrainer: `python -m model_zoo.bert_squad`.

Modules: `modeling` (BERT + span head, stage scopes), `tokenization` (WordPiece),
`squad` (SQuAD JSON, windows), `evaluation` (answer extraction, official EM/F1),
`checkpoint` (Google `bert_model.ckpt`), `builtin_data` (generated dataset and vocab),
`recipe` (the default EPL config).
"""
