"""KV-cache memory: request->token map, paged DSV4 pools, compressor state, allocators."""
