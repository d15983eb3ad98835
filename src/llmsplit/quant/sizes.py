"""What packed weights cost in bytes, with no torch: the loader's placement
(`io.weights.packed_unit_bytes`) and the planner (`plan --quantize`) count with the same
functions, so a plan's weights are the bytes a packed load holds."""

from __future__ import annotations

MODES = ("int8", "int4", "none")  # --quantize
INT4_GROUP = 32  # the smallest group the CPU kernel takes: the best int4 quality it offers
ROW_ALIGN = 64  # the CPU int4 layout works in blocks of 64 (avx512) or 32 output rows


def is_matmul_weight(name: str) -> bool:
    """The weights kept packed: every linear layer's, the head's and the embedding's (a
    lookup dequantizes just the rows it reads). Norms and biases stay float."""
    return name.endswith("weight") and "norm" not in name


def kind_for(name: str, mode: str) -> str:
    """The packing `--quantize mode` gives weight `name`: int4 keeps the embedding and the head
    at int8 (one scale a row), as llama.cpp's 4-bit schemes keep the output in more bits. On
    SmolLM2-135M (tied): all int4 +5.9% perplexity over fp32, int4 with an int8
    embedding/head +0.17%, for 92.5 instead of 82.3 MiB (BENCHMARKS.md)."""
    if mode == "int4" and name in ("tok_embeddings.weight", "output.weight"):
        return "int8"
    return mode


def packed_nbytes(shape: tuple[int, int], kind: str, native: bool = True) -> int:
    """Bytes a weight [out, in] takes packed as `kind`: "int4" (groups of 32, a 16-bit scale and
    zero or min each), "q8_0" (two nibble matrices: the file's float16 d a block where
    int4_matmul.cpp runs, `native`, else a scale and zero for each nibble matrix's group),
    "int8" (one bf16 scale a row); rows padded as the int4 layout pads them."""
    n, k = shape
    rows = -(-n // ROW_ALIGN) * ROW_ALIGN
    if kind == "int8":
        return n * k + 2 * n
    if kind == "q8_0":
        return rows * k + rows * (k // INT4_GROUP) * (2 if native else 8)
    return rows * k // 2 + rows * (k // INT4_GROUP) * 4
