from .api import gather_dequant

__all__ = ["gather_dequant"]
