"""Quickstart: a small Keras classifier trained data-parallel with `EPLTrainer`.

Run it::

    python -m model_zoo.quickstart                      # 2 simulated devices, ~10 s on CPU
    python -m model_zoo.quickstart --epochs 3 --epl_set cluster.virtual_devices=4
    python -m model_zoo.quickstart --epl_config configs/dp.json

    # 2 worker processes with 1 device each, TF_CONFIG set by the launcher
    epl-launch --num_workers 2 --gpu_per_worker 1 model_zoo/quickstart/__main__.py

The code is in `__main__.py`, which also runs as a plain script file (what `epl-launch`
does). This package module stays empty on purpose: `python -m` imports the package
before it runs `__main__`, and the absl flags must be defined only once.
"""
