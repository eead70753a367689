"""Tensor split (`epl.split`): layers whose weights are sharded over the lanes of a replica."""
