"""The shapes of the fused loss head's matmuls: tokens per chunk, classes per vocabulary slice.

The code chooses two of each matmul's dimensions: the rows of a token chunk and the columns of a
vocabulary slice (the third, the hidden size, is the model's). Both are multiples of 128 elements
(only the last chunk or slice takes the rest), so that every operand and result the head allocates
has a leading dimension aligned to 16 bytes, which Hopper's TMA-based cuBLAS kernels require (an
unaligned one falls back to sm80 kernels: at Qwen3's vocabulary, 151936, slices of 2374 classes
made the backward's matmuls run 2-3 times longer). A vocabulary that is not a multiple of 8 gets
its logits in a buffer whose rows are padded to 16 bytes (``padded_row``), as inductor's
``shape_padding`` pads such matmuls, and its matmul is made in two, the classes of whole 16 bytes
(``aligned_classes``) and the few left.
"""

from __future__ import annotations

__all__ = ["chunk_tokens", "vocabulary_width", "gradient_slices", "padded_row", "aligned_classes", "spans"]

# Elements of one chunk's fp32 logits (128 MiB): big enough for efficient matmuls, small next to
# the activations.
_CHUNK_LOGIT_ELEMENTS = 128 * 2**20 // 4
_MULTIPLE = 128
_MIN_CHUNKS = 8
# On CUDA a chunk of fewer rows re-reads the whole weight per chunk at fewer than 512 FLOPs a byte
# (2 x rows x vocab x hidden FLOPs for 2 x vocab x hidden bytes of bf16 weight): below the H100's
# ridge of about 295 (989 TFLOP/s over 3.35 TB/s), so the matmul would wait for memory.
_MIN_CUDA_ROWS = 512
_ALIGN_BYTES = 16
# One slice of the logits' gradient where the logits are held whole (gradient_slices).
GRADIENT_SLICE_BYTES = 512 * 2**20


def _down(n: int) -> int:
    """``n`` rounded down to a multiple of 128, and at least 128."""
    return max(_MULTIPLE, n // _MULTIPLE * _MULTIPLE)


def chunk_tokens(tokens: int, vocab: int, *, gradients_in_forward: bool = False, device: str = "cpu") -> int:
    """Tokens per chunk: fp32 logits of about 128 MiB, and at least eight chunks where that would
    leave fewer (so that a small head's chunk is still small next to its logits), a multiple of
    128 tokens, on CUDA at least 512 (the weight is read once per chunk: see _MIN_CUDA_ROWS), at
    most all (and at least one, so that no input makes a step of zero).

    With the gradients in the forward on CUDA, all tokens: there the logits are written into the
    logits' gradient buffer, tokens x vocab anyway, and each chunk's math is one compiled kernel
    without an fp32 copy, so one chunk costs no memory and makes one whole matmul."""
    if gradients_in_forward and device == "cuda":
        return max(1, tokens)
    per_chunk = _down(min(_CHUNK_LOGIT_ELEMENTS // vocab, -(-tokens // _MIN_CHUNKS)))
    if device == "cuda":
        per_chunk = max(per_chunk, _MIN_CUDA_ROWS)
    return max(1, min(tokens, per_chunk))


def vocabulary_width(tokens: int, vocab: int, chunk: int) -> int:
    """Classes per slice when the backward walks the vocabulary (fewer tokens than classes): as many
    logits as one chunk of ``chunk`` tokens holds, but no more than the 128 MiB of fp32 logits of
    chunk_tokens (where CUDA's minimum of rows made the chunk larger), rounded down to a multiple of
    128 classes (at least 128); all classes when that is fewer, or when there are no tokens."""
    if not tokens:
        return vocab
    rows = min(chunk, max(1, _CHUNK_LOGIT_ELEMENTS // vocab))
    return min(vocab, _down(rows * vocab // tokens))


def gradient_slices(tokens: int, vocab: int, element_bytes: int) -> tuple[int, int]:
    """(rows, classes) of each slice of the logits' gradient where the head computes it from its
    logits held whole (the model returns them): slices of the vocabulary, all tokens each, where
    there are fewer tokens than classes, else chunks of tokens, all classes each; of about
    GRADIENT_SLICE_BYTES in the model's dtype, a multiple of 128 (the last takes the rest). Wide,
    so that each slice's two products, its part of the weight's gradient and its sum into the
    hidden states', are matmuls of full rate, and the sum's fp32 accumulator is read and written
    few times."""
    if tokens < vocab:
        return tokens, min(vocab, _down(GRADIENT_SLICE_BYTES // element_bytes // max(1, tokens)))
    return min(tokens, _down(GRADIENT_SLICE_BYTES // element_bytes // vocab)), vocab


def padded_row(columns: int, element_bytes: int) -> int:
    """The row length (elements) of a buffer for ``columns`` columns whose rows start 16-byte
    aligned: ``columns`` rounded up to a multiple of 16 bytes."""
    per = max(1, _ALIGN_BYTES // element_bytes)
    return -(-columns // per) * per


def aligned_classes(columns: int, element_bytes: int) -> int:
    """The most of ``columns`` that fill whole 16-byte groups: ``columns`` rounded down to a multiple
    of 16 bytes' elements."""
    per = max(1, _ALIGN_BYTES // element_bytes)
    return columns // per * per


def spans(total: int, step: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive chunks of ``step`` (the last one shorter) covering ``total``."""
    return [(start, min(total, start + step)) for start in range(0, total, step)]
