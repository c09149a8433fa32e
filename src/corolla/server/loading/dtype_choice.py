"""Which dtype a server computes in: ``--dtype float32|bfloat16|float16`` as given, or ``--dtype auto``.

``auto`` takes the checkpoint's own dtype (``config.dtype``, stored as ``torch_dtype`` in config.json) on an
accelerator, where half-precision matmuls are fast; on the CPU it takes float32, because bfloat16 matmuls on
a few CPU cores are several times slower than float32 ones and float32 is exact against the reference.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

SERVER_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *SERVER_DTYPES)


def checkpoint_dtype_name(config: object) -> str | None:
    """The checkpoint's dtype as a name (``"bfloat16"``), read from ``config.dtype`` or ``config.torch_dtype``;
    ``None`` when the config does not say."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)  # a torch.dtype or a str
    return str(value).removeprefix("torch.") if value else None


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: torch.device | str) -> tuple[str, torch.dtype]:
    """``(name, dtype)`` the server's blocks compute in, for ``--dtype requested`` (one of ``DTYPE_CHOICES``).

    ``auto``: ``checkpoint_dtype`` on a non-CPU device when it is one of ``SERVER_DTYPES`` (float32 otherwise,
    e.g. when the checkpoint does not say); float32 on the CPU. Raises ``ValueError`` for an unknown name.
    """
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    if requested != "auto":
        return requested, SERVER_DTYPES[requested]
    on_cpu = torch.device(device).type == "cpu"
    name = "float32" if on_cpu or checkpoint_dtype not in SERVER_DTYPES else checkpoint_dtype
    logger.info("--dtype auto: computing in %s (checkpoint dtype %s, device %s)", name, checkpoint_dtype, device)
    return name, SERVER_DTYPES[name]
