"""Reading and writing: HF safetensors and GGUF readers, convert (Orbax), load, drafts on disk,
the embedded default model and the prompt sets."""
