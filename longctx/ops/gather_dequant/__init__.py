from .api import FlashPages, gather_dequant, gather_dequant_pages

__all__ = ["FlashPages", "gather_dequant", "gather_dequant_pages"]
