"""DSV4 attention pieces: metadata (with breakable-graph field classes), builders, compressor, indexer."""
