"""The real SmolLM2-135M-Instruct Q4_1 GGUF (the embedded default model): converted to float32,
its logits and greedy tokens match transformers loading the same GGUF (which dequantizes to
float32 and undoes llama.cpp's q/k permutation itself)."""

import numpy as np
import pytest
import torch

from jaxspec.io.convert import convert, load
from jaxspec.io.default_model import default_gguf_path

N_NEW = 32
ATOL = 1e-3


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    ckpt = convert(
        gguf, tmp_path_factory.mktemp("smollm2") / "ckpt", dtype="float32", progress=False
    )
    model = load(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return model, hf, [int(i) for i in ids]


def _hf_greedy(hf, prompt, n):
    out, past = [], None
    x = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            res = hf(input_ids=x, cache=past, use_cache=True)
            past = res.cache
            out.append(int(res.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def test_config_and_tokenizer(real):
    model, hf, prompt = real
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps, rel=0, abs=0)
    assert model.tokenizer.chat_template and prompt[0] == cfg.bos_token_id == 1
    assert model.tokenizer.decode(prompt).startswith("<|im_start|>system")


def test_logits_match_transformers(real):
    model, hf, prompt = real
    ours = np.asarray(model.logits(np.array([prompt])))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompt])).logits.numpy()
    assert np.abs(want).max() > 10  # real logits, not a degenerate comparison
    np.testing.assert_allclose(ours, want, rtol=0, atol=ATOL)


def test_greedy_tokens_match_transformers(real):
    """32 greedy tokens are identical. One causal forward over prompt + HF's greedy tokens gives
    the logits a step-by-step greedy loop would see at every step (same prefixes), so equal
    argmaxes at every step mean our greedy loop emits exactly these tokens."""
    model, hf, prompt = real
    want = _hf_greedy(hf, prompt, N_NEW)
    seq = prompt + want
    ours = np.asarray(model.logits(np.array([seq])))[0, len(prompt) - 1 : -1]
    got = [int(t) for t in ours.argmax(-1)]
    top2 = np.sort(ours, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert got == want, (
        f"first difference at step {next(i for i in range(N_NEW) if got[i] != want[i])}"
    )
    assert margin > ATOL  # no near-tie decided by numerical noise
    assert "Paris" in model.tokenizer.decode(want)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([seq])).logits.numpy()[0, len(prompt) - 1 : -1]
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)


def test_tokenizer_built_without_torch_equals_transformers_gguf_tokenizer(real):
    """jaxspec reads the GGUF's tokenizer metadata itself (transformers' reader imports torch,
    which the main install lacks); it must encode exactly as transformers' own GGUF loader."""
    from transformers import AutoTokenizer

    model, _, _ = real
    gguf = default_gguf_path()
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    texts = [
        "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))",
        "  leading spaces, tabs\tand\r\nnewlines  ",
        "Ünïcödé — 日本語 🙂 ½",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
        "12345 1,000,000 3.14159 x**2",
    ]
    for text in texts:
        assert model.tokenizer.encode(text) == ref.encode(text), text
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert model.tokenizer.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
        chat, tokenize=False
    )
    assert len(model.tokenizer) == len(ref)


@pytest.mark.slow  # 80 s on CI's 2 cores; test_fused_linear runs the same paths on tiny models
def test_fast_paths_decode_the_real_model_like_the_plain_path(real, monkeypatch):
    """The GPU fast paths (the Pallas attention kernel and the fused projection kernels), run
    through the Pallas interpreter on the real model in float32, emit the plain path's greedy
    tokens (issue 10's check on CPU; the GPU run repeats it in bf16)."""
    import jax

    import jaxspec
    from jaxspec.engines import programs
    from jaxspec.kernels import KernelConfig
    from pallas_kernels import decode_attention as D
    from pallas_kernels import fused_linear

    model, _, prompt = real
    traced = []
    for mod, name in ((D, "decode_attention"), (fused_linear, "silu_project")):
        fn = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, _fn=fn, _n=name, **k: traced.append(_n) or _fn(*a, **k)
        )

    def decode(attention, fused):
        programs._COMPILED.clear()  # so the spies see this run's traces
        jax.clear_caches()
        kernels = KernelConfig(attention=attention, fused_linear=fused)
        return jaxspec.generate(model, [prompt], max_new_tokens=8, kernels=kernels).tokens[0]

    plain = decode("reference", "off")
    assert not traced
    assert decode("interpret", "interpret") == plain
    assert {"decode_attention", "silu_project"} <= set(traced), "a fast path was not traced"
    programs._COMPILED.clear()
    jax.clear_caches()
