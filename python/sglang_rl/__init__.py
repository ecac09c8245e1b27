"""sglang-rl: an SGLang plugin for RL rollouts and verifiable inference."""

__version__ = "0.1.0"
