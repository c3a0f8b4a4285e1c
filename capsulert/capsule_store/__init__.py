"""Capsules and their store: tiers (gpu, host, disk), moves between them, the on-disk format."""
