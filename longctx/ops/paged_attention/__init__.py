from .api import dense_attention, paged_attention

__all__ = ["dense_attention", "paged_attention"]
