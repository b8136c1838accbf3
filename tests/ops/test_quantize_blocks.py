import pytest
import torch

from longctx.errors import BackendUnavailableError
from longctx.ops.quantize_blocks import quantize_blocks
from longctx.quant import BlockFormat, dequantize_v, quantize_k, rotate


@pytest.mark.parametrize("kb, vb, rot", [(8, 8, False), (4, 4, False), (2, 2, True), (8, 4, False), (16, 4, False), (16, 16, False)],
                         ids=["int8", "int4", "int2+rot", "k8v4", "k16v4", "bf16"])
def test_quantize_blocks_matches_format(kb, vb, rot):
    fmt = BlockFormat(kb, vb, 16, 32, 64, 2, torch.float32, rot)
    k, v = torch.randn(5, 2, 16, 64), torch.randn(5, 2, 16, 64)
    out = quantize_blocks(k, v, fmt)
    if kb == 16:
        assert torch.equal(out["k"], k)
    else:
        ck, sk, zk = quantize_k(rotate(k) if rot else k, kb, torch.float32)
        assert torch.equal(out["k_codes"], ck) and torch.equal(out["k_scale"], sk) and torch.equal(out["k_zero"], zk)
        assert out["k_codes"].shape == (5, 2, 16, 64 * kb // 8)
    if vb == 16:
        assert torch.equal(out["v"], v)
    else:
        assert out["v_scale"].shape == (5, 2, 16, 2)
        rec = dequantize_v(out["v_codes"], out["v_scale"], out["v_zero"], vb, 32, torch.float64)
        stored = (rotate(v) if rot else v).double()  # codes live in the rotated space
        step = out["v_scale"].double().repeat_interleave(32, -1)
        assert ((rec - stored).abs() <= step / 2 * (1 + 1e-6)).all()


def test_quantize_blocks_validates_shapes():
    fmt = BlockFormat(4, 4, 16, 64, 64, 2, torch.float32)
    with pytest.raises(ValueError, match=r"k must be \[N, 2, 16, 64\], got \(3, 2, 8, 64\)"):
        quantize_blocks(torch.randn(3, 2, 8, 64), torch.randn(3, 2, 8, 64), fmt)
    with pytest.raises(BackendUnavailableError):
        quantize_blocks(torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64), fmt, backend="triton9")
