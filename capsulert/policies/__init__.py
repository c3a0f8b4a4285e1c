"""Pluggable pinning, promotion and eviction policies for the capsule store (ABC + registry)."""
