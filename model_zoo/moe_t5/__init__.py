"""MoE-T5: a T5-style encoder-decoder with mixture-of-experts feed-forward blocks whose
experts are split across devices (EPL's MoE recipe, `configs/moe_t5_split.json`).

Run it::

    python -m model_zoo.moe_t5                 # generated task, 2 simulated devices
    python -m model_zoo.moe_t5 --train_files 'data/train*.tsv' --eval_files data/dev.tsv \\
        --vocab_file data/vocab.txt --max_source_length 64 --max_target_length 64

The code is in `__main__.py` (flags, training loop), `model.py` (the model, loss, token
accuracy, router statistics, greedy decoding) and `data.py` (vocabulary, generated task,
TSV / TFRecord readers). This package module stays empty on purpose: `python -m`
imports the package before it runs `__main__`, and the absl flags must be defined once.
"""
