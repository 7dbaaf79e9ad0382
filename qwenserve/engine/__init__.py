"""The inference engine: models on a paged KV cache with continuous batching (no network here)."""
