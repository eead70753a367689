"""The Keras-facing trainer: `EPLTrainer`'s loop, fit's arguments and data, compile()'s
structures, checkpoints, logs and the memory report. Imports TensorFlow."""
