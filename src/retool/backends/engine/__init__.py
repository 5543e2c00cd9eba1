"""The local sampler's decoding engine: continuous batching over a KV cache (``generation``), the prefix
cache it reuses finished sequences' KV from (``prefix_cache``) and the lean one-token forward of its decode
steps on Llama / Qwen2 models (``decode_step``).

Runs any torch causal LM it is handed; knows no trainer. Imports the interface only.
"""
