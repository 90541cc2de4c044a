"""Reading and writing: the HF safetensors (hf) and GGUF (gguf) readers, convert (Orbax), load,
drafts on disk, the embedded default model, the prompt sets, and where writes go (paths: output
checks, temporary folders, Ctrl-C during a write)."""
