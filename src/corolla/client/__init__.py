"""The client: holds embeddings and the LM head, routes hidden states through the swarm's servers."""
