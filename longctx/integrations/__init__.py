"""Integrations with model libraries; `transformers` is imported only here and in models.py."""
