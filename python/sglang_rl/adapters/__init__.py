"""Thin adapters that wire the engine-agnostic cores into sglang (all registered in hooks.py)."""
