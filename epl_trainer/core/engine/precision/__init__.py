"""Mixed precision and loss scaling, and updates applied only when gradients are finite."""
