"""Serving layer: streams generated text to OpenAI-compatible clients."""
