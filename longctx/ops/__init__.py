"""Operations over the paged KV format. One folder per op: api.py validates and dispatches,
reference.py defines correct in eager torch, kernels live beside it."""
