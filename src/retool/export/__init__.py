"""retool.export: the stage after evaluate. It turns a trained model into the formats serving engines load;
for now the GGUF writer (``retool.export.gguf``: llama.cpp and Ollama)."""
