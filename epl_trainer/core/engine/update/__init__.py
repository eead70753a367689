"""The update half of a step: gradient reduction, clipping, the optimizer apply and its slots."""
