"""Adapters that hand sglang-rl outputs to RL frameworks; none imports the framework itself."""
