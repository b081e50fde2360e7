"""Tokenizer, sources, token shards, loaders and chat formatting."""
