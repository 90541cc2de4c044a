"""The model: the NNX transformer, its KV cache and block spec, tensor-parallel layouts."""
