"""Reading Hugging Face checkpoints selectively: a server loads only its blocks' tensors, a client
only the embeddings, final norm and LM head, from a local directory or a hub repo (downloading only
the files that hold them, into a size-limited LRU disk cache)."""

from corolla.checkpoint.reader import checkpoint_files_for, load_tensors
from corolla.checkpoint.source import CheckpointSource, load_config

__all__ = ["CheckpointSource", "checkpoint_files_for", "load_config", "load_tensors"]
