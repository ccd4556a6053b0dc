"""The command line the GPU numerics diagnostics share: which models, how many layers, how long a
sequence, each checked by the package's argument types (a bad value is one line, exit 2)."""

from __future__ import annotations

import argparse

import torch

from thunder_memopt.arguments import litgpt_model_name, positive_int


def numerics_parser(doc: str, *, models: list[str], seq_len: int) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph, with --models, --layers and --seq-len."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", type=litgpt_model_name, default=models)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--seq-len", type=positive_int, default=seq_len)
    return parser


def parse_on_gpu(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, or argparse's one-line error where there is no GPU."""
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    return args
