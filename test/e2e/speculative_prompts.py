"""Prompts the speculative-decoding e2e tests share: one that repeats a token (drafts that propose
it are accepted), and three ordinary ones."""

REPEATING = "Repeat the word hello ten times: hello hello hello"
PROMPTS = [
    REPEATING,
    "The capital of France is",
    "def fib(n):\n    if n < 2:\n        return n\n",
    "Write a haiku about the sea.",
]
MAX_NEW = 24
