"""Benchmarks on a GPU, each against its peers in the same process: `decode` (attention of one
decode step per layer), `prefill` (a prompt's last chunk per layer), `seal` (what sealing adds
to a decode step), `e2e` (a Llama-3-8B-shaped model, whole steps), `plan` (`longctx plan`
against a measured peak), `offload` (past the GPU, the host tier) and `disk` (a saved cache
loaded against prefilling again). Each returns rows
(dataclasses); the CLI (`longctx bench`) renders them. `common` holds what they share."""

from .common import SHAPES, bench_configs, copy_view, sealing_share, synthetic_view, view_bytes, view_nbytes
from .common import SLACK, bench_setup, copies_for, format_config, time_calls, time_graph  # noqa: F401 - for tools/ and tests
from .decode import DecodeRow, bench_decode, decode_cases, flash_attn_pages
from .e2e import STATIC_WARMUP, E2ERow, bench_e2e, llama3_8b_shaped
from .plan import PlanCheckRow, bench_plan
from .prefill import PrefillRow, bench_prefill
from .seal import SealRow, bench_seal

__all__ = ["SHAPES", "STATIC_WARMUP", "DecodeRow", "E2ERow", "PlanCheckRow", "PrefillRow", "SealRow", "bench_configs", "bench_decode", "bench_e2e",
           "bench_plan", "bench_prefill", "bench_seal", "copy_view", "decode_cases", "flash_attn_pages", "llama3_8b_shaped", "sealing_share",
           "synthetic_view", "view_bytes", "view_nbytes"]
