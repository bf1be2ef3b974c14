"""Reward modeling: pairwise loss, metrics, normalization. Built in issue #3; nothing here yet."""
