"""The server: loads a contiguous range of blocks, announces it in the DHT and serves RPCs on P2P streams."""
