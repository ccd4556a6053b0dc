"""The transformers models of ``--model-source transformers``: ``thunder_memopt.hf_models``, which
``python -m thunder_memopt plan`` shares, under the name the benchmark's modules use."""

from thunder_memopt.hf_models import *  # noqa: F401,F403
