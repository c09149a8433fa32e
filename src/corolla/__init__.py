"""corolla: run large language models across a swarm of machines.

Servers host contiguous ranges of transformer blocks; a client keeps the embeddings, final norm and LM head,
and sends hidden states through a chain of servers found through a DHT.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("corolla")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"


def __getattr__(name: str):  # lazy: importing corolla must stay cheap and side-effect free
    if name in ("AutoDistributedModelForCausalLM", "DistributedModelForCausalLM"):
        from corolla.client.model import causal_lm

        return getattr(causal_lm, name)
    if name in ("AutoDistributedModelForSequenceClassification", "DistributedModelForSequenceClassification"):
        from corolla.client.model import classification

        return getattr(classification, name)
    if name == "ClientConfig":
        from corolla.client.config import ClientConfig

        return ClientConfig
    raise AttributeError(f"module 'corolla' has no attribute {name!r}")


__all__ = [
    "AutoDistributedModelForCausalLM", "DistributedModelForCausalLM", "AutoDistributedModelForSequenceClassification",
    "DistributedModelForSequenceClassification", "ClientConfig", "__version__",
]
