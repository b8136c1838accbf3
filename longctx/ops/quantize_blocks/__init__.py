from .api import quantize_blocks

__all__ = ["quantize_blocks"]
