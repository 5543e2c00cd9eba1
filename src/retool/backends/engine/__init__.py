"""The local sampler's decoding engine: continuous batching over a KV cache (``generation``) and the prefix
cache it reuses finished sequences' KV from (``prefix_cache``).

Runs any torch causal LM it is handed; knows no trainer. Imports the interface only.
"""
