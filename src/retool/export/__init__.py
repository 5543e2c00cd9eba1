"""retool.export: the stage after evaluate. It turns what training left (a ``retool train`` run's
checkpoints, a recipe demo's SFT or RL model, any model folder) into the formats serving engines load: a
merged Hugging Face folder (transformers, vLLM), the LoRA adapter alone in PEFT's format, and GGUF files
(llama.cpp, Ollama), with a model card that states the base model, data, recipe, steps, evaluation, license
and the tool protocol the model expects; optionally pushed to the Hugging Face Hub. ``retool export``.

Modules: ``source`` (which folder holds which weights), ``weights`` (the merge; ``hf`` and ``peft``),
``gguf`` (the GGUF writer), ``card`` (the model card), ``hub`` (the push), ``writer`` (one export, all or
nothing), ``cli``. Nothing here imports torch until an export runs.
"""

from retool.export.errors import ExportError
from retool.export.writer import FORMATS, ExportRequest, ExportResult, export_model

__all__ = ["FORMATS", "ExportError", "ExportRequest", "ExportResult", "export_model"]
