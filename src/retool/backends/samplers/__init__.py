"""Samplers that plug into the local trainer in place of (or beside) its own engine.

- ``llamacpp``: llama.cpp on CPU over the original GGUF plus the trainer's LoRA as an adapter GGUF
  (``backend.engine = "llamacpp"``).
- ``vllm``: vLLM over a frozen base with the trainer's LoRA handed over by request (``backend.engine = "vllm"``).
- ``multi_lora``: one engine for every LoRA adapter on a shared base (``retool serve``).

Above the local backend: each takes a ``LocalTrainingClient``. Never imported by the remote adapters.
"""
