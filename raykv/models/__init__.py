"""Small local models for demos and tests."""

from raykv.models.tiny import build_tiny_model, make_prompt_tokens

__all__ = ["build_tiny_model", "make_prompt_tokens"]
