"""Helpers for tests: tiny, locally built models and tokenizers."""
