"""DSV4 attention pieces: metadata (with BCG field classes), builders, compressor, indexer."""
