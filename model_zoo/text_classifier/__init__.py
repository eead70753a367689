"""A KerasHub `BertTextClassifier` trained on raw strings with `EPLTrainer`.

Run it::

    python -m model_zoo.text_classifier                 # built-in data, 2 simulated devices
    python -m model_zoo.text_classifier --train_file train.tsv --dev_file dev.tsv \\
        --vocab_file uncased_L-12_H-768_A-12/vocab.txt

The code is in `__main__.py` (flags), `recipe.py` (the run) and `data.py` (the built-in
data set, GLUE-style TSV files, the vocabulary). This package module stays empty on
purpose: `python -m` imports the package before it runs `__main__`, and the absl flags
must be defined only once.
"""
