from .api import quantize_blocks, quantize_blocks_into

__all__ = ["quantize_blocks", "quantize_blocks_into"]
