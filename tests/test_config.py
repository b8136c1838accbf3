import pytest

from longctx import KVConfig


def test_defaults():
    cfg = KVConfig()
    assert (cfg.bits, cfg.block_size, cfg.sink_blocks, cfg.rotate) == (4, 64, 1, False)
    assert cfg.layer_bits(0) == (4, 4)
    assert cfg.describe() == "int4"


def test_mixed_bits_and_16bit_layers():
    cfg = KVConfig(bits=4, k_bits=8, layers_16bit=[3, 1])
    assert cfg.layers_16bit == (1, 3)
    assert cfg.layer_bits(0) == (8, 4) and cfg.layer_bits(1) == (16, 16)
    assert cfg.describe() == "k8v4"
    assert KVConfig(bits=2, rotate=True).describe() == "int2+rot"
    assert KVConfig(bits=16).describe() == "bf16"


@pytest.mark.parametrize(
    "field, value",
    [
        ("bits", 3),
        ("bits", 32),
        ("bits", True),
        ("k_bits", 5),
        ("v_bits", 1),
        ("block_size", 48),
        ("block_size", 8),
        ("block_size", 512),
        ("k_span", 8),
        ("k_span", 24),
        ("k_span", 128),  # more than the page (64)
        ("k_span", True),
        ("group_size", 0),
        ("sink_blocks", -1),
        ("rotate", "yes"),
        ("layers_16bit", (-1,)),
        ("dtype", "int8"),
        ("max_blocks", 0),
        ("backend", "cuda-magic"),
    ],
)
def test_invalid_values_name_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        KVConfig(**{field: value})
    msg = str(err.value)
    assert f"KVConfig.{field}=" in msg and repr(value) in msg


def test_resolve_checks_model_dependent_fields():
    assert KVConfig().resolve(4, 64).group_size == 64
    assert KVConfig().resolve(4, 32).group_size == 32
    assert KVConfig().resolve(4, 96).group_size == 48
    assert KVConfig().resolve(4, 128).group_size == 64
    # 8-bit values: whole heads up to 128 channels (keys' bits do not matter: groups are V's)
    for cfg in (KVConfig(bits=8), KVConfig(bits=4, v_bits=8)):
        assert [cfg.resolve(4, d).group_size for d in (64, 96, 128, 256)] == [64, 96, 128, 128]
    assert KVConfig(bits=8, v_bits=4).resolve(4, 128).group_size == 64
    assert KVConfig(bits=8, group_size=32).resolve(4, 128).group_size == 32
    with pytest.raises(ValueError, match="group_size=48.*head_dim=64"):
        KVConfig(group_size=48).resolve(4, 64)
    with pytest.raises(ValueError, match="rotate.*power-of-two head_dim.*96"):
        KVConfig(rotate=True).resolve(4, 96)
    with pytest.raises(ValueError, match="layers_16bit.*num_layers=4"):
        KVConfig(layers_16bit=(4,)).resolve(4, 64)


def test_frozen():
    with pytest.raises(Exception):
        KVConfig().bits = 8


def test_config_yaml_builds_the_same_config_again(tmp_path):
    import yaml

    from longctx.config import config_yaml

    kv = KVConfig(bits=4, k_bits=8, block_size=16, group_size=32, layers_16bit=[3, 1], rotate=True, max_blocks=7, backend="reference")
    text = config_yaml(kv=kv, formats={"int8": KVConfig(bits=8)}, cases=[(4096, 1), (32768, 8)], file=tmp_path / "doc.txt",
                       dtype=complex(1, 2), none=None)
    data = yaml.safe_load(text)
    assert KVConfig(**data["kv"]) == kv and KVConfig(**data["formats"]["int8"]) == KVConfig(bits=8)
    assert data["kv"]["layers_16bit"] == [1, 3] and data["cases"] == [[4096, 1], [32768, 8]]
    assert data["file"] == str(tmp_path / "doc.txt") and data["dtype"] == "(1+2j)" and data["none"] is None
    assert list(data) == ["kv", "formats", "cases", "file", "dtype", "none"]  # in the order given


def test_kv_presets_are_the_named_formats():
    from longctx.bench import format_config
    from longctx.config import kv_preset, kv_preset_names

    assert kv_preset_names() == ["bf16", "int8", "k8v4", "int4", "int4+rot", "int2+rot"]
    assert {n: kv_preset(n).describe() for n in kv_preset_names()} == {n: n for n in kv_preset_names()}  # each name says what it is
    assert kv_preset("int2+rot") == KVConfig(bits=2, rotate=True, k_span=16)  # K's ranges over 16 tokens, pages of 64
    assert kv_preset("int4", block_size=128) == KVConfig(bits=4, block_size=128)
    with pytest.raises(ValueError, match="unknown format 'int3'; choose from bf16, int8"):
        kv_preset("int3")
    # the benches take them at their block size, and "int2" as int2+rot
    assert format_config("int2", 64) == format_config("int2+rot", 64) == KVConfig(bits=2, rotate=True, k_span=16, block_size=64)
    assert format_config("int2+rot", 16) == KVConfig(bits=2, rotate=True, k_span=16, block_size=16)  # a span a page


def test_bits_stand_for_the_named_formats():
    """`chat --kv-bits N` and `plan`'s bits take the named formats of kv.yaml: one definition."""
    from longctx.config import BITS_FORMATS, bits_format, kv_preset

    assert {b: bits_format(b) for b in (16, 8, 4, 2)} == {b: kv_preset(n) for b, n in BITS_FORMATS.items()}
    assert bits_format(2) == KVConfig(bits=2, rotate=True, k_span=16)
    assert bits_format(2, block_size=128) == KVConfig(bits=2, rotate=True, k_span=16, block_size=128)
    with pytest.raises(ValueError, match="kv bits must be 16, 8, 4 or 2, got 3"):
        bits_format(3)


def test_k_span_sets_the_scale_rows_of_a_page():
    import torch

    cfg = KVConfig(bits=2, rotate=True, k_span=16).resolve(2, 128)
    fmt = cfg.block_format(0, 128, 8, torch.bfloat16)
    assert (cfg.key_span, fmt.k_span, fmt.k_groups) == (16, 16, 4)
    # a scale and a zero a channel per span: 4 x 2 x 128 x 2 bytes a head, against one row's 512
    assert fmt.block_bytes()["scales"] - KVConfig(bits=2, rotate=True).resolve(2, 128).block_format(0, 128, 8, torch.bfloat16).block_bytes()["scales"] \
        == 8 * 3 * 2 * 128 * 2
    assert KVConfig(bits=4).resolve(2, 128).block_format(0, 128, 8, torch.bfloat16).k_groups == 1
