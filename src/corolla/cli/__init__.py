"""The `corolla` command line: dht, serve, generate, chat, status, demo."""
