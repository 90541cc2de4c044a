"""Quantized checkpoints: GGUF Q8_0 / Q4_0 / Q4_1 blocks and AWQ weights kept quantized, other
GGUF types dequantized with a note, ``quantize="int8" / "int4"`` of a float checkpoint, Orbax
holding codes and scales, ``load`` onto one device or a tensor-parallel mesh, and the bad inputs
(an unreadable type, a truncated block, a group size that does not divide), each leaving nothing
behind."""

from __future__ import annotations

import json
import os
import sys

import gguf
import jax
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.errors import CheckpointError, OptionError
from jaxspec.io import awq as awq_io
from jaxspec.model import quantized as Q
from pallas_kernels import quant
from tests.hf_fixtures import awq_pack, make_hf_model, write_awq, write_gguf

T = gguf.GGMLQuantizationType
# layer 0 Q4_1, layer 1 Q4_0, the embedding (tied: also the LM head) Q8_0, one tensor Q5_0
TYPES = {"token_embd.weight": T.Q8_0, "blk.1.ffn_down.weight": T.Q5_0}
for _i, _t in ((0, T.Q4_1), (1, T.Q4_0)):
    for _n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        TYPES.setdefault(f"blk.{_i}.{_n}.weight", _t)


def _pure(model):
    return nnx.to_pure_dict(model.params)


def _fails(fn, dst, match, exc=CheckpointError):
    """``fn()`` raises ``exc`` and leaves nothing beside ``dst`` (no temporary folders)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    before = sorted(os.listdir(dst.parent))
    with pytest.raises(exc, match=match) as info:
        fn()
    assert sorted(os.listdir(dst.parent)) == before, "convert left files behind"
    return info.value


@pytest.fixture(scope="module")
def hf():
    # tied embeddings, GQA, 64 wide, 2 layers; an MLP of 128 (GGUF blocks cut rows by 32)
    model = make_hf_model("llama3.2", seed=3, intermediate_size=128)
    model.config.architectures = ["LlamaForCausalLM"]
    return model


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, hf):
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "m.gguf", types=TYPES)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory, gguf_file):
    """(kept quantized, dequantized) checkpoints of the same GGUF, both float32."""
    root = tmp_path_factory.mktemp("ck")
    kept = jaxspec.convert(gguf_file, root / "q", dtype="float32", progress=False)
    flat = jaxspec.convert(gguf_file, root / "f", dtype="float32", quantize="none", progress=False)
    return kept, flat


def test_gguf_blocks_are_kept_and_recorded(gguf_pair, capsys):
    kept, _ = gguf_pair
    meta = json.loads((kept / "config.json").read_text())["quantization"]
    assert meta["method"] == "gguf"
    tensors = meta["tensors"]
    assert tensors["embed_tokens"] == {"bits": 8, "group": 32, "scales": "float16", "mins": None}
    assert tensors["layers.0.mlp.up_proj.kernel"]["mins"] == "float16"  # Q4_1: d * q + m
    assert tensors["layers.1.mlp.up_proj.kernel"]["mins"] is None  # Q4_0: d * (q - 8)
    assert "layers.1.mlp.down_proj.kernel" not in tensors  # Q5_0: dequantized
    model = jaxspec.load(kept, quantized=True)
    table = _pure(model)["embed_tokens"]
    assert quant.is_quantized(table) and table.shape == (64, 96)  # [D, V]: the LM head too
    assert not quant.is_quantized(_pure(model)["layers"][1]["mlp"]["down_proj"]["kernel"])


def test_other_gguf_types_are_dequantized_with_a_note(gguf_file, tmp_path, capsys):
    jaxspec.convert(gguf_file, tmp_path / "q", progress=False)
    err = capsys.readouterr().err
    assert "note:" in err and "1 in Q5_0" in err and "dequantized to bfloat16" in err
    jaxspec.convert(gguf_file, tmp_path / "f", quantize="none", progress=False)
    assert "note:" not in capsys.readouterr().err  # nothing was meant to stay quantized


def test_gguf_blocks_dequantize_to_the_gguf_packages_values_bit_for_bit(gguf_pair):
    """Every kept weight, dequantized, equals the gguf package's own float32 dequantization
    (the quantize="none" checkpoint), q/k permutation undone alike; the quantized model's logits
    equal the dequantized model's within float32 tolerance."""
    kept, flat = gguf_pair
    q, f = jaxspec.load(kept, quantized=True), jaxspec.load(flat)
    want = _pure(f)
    got = Q.dequantize_params(_pure(q))
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want),
        strict=True,
    ):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    tokens = np.arange(3, 40)[None] % 96
    lq, lf = np.asarray(q.logits(tokens)), np.asarray(f.logits(tokens))
    assert np.abs(lf).max() > 1
    np.testing.assert_allclose(lq, lf, rtol=0, atol=1e-5 * np.abs(lf).max())


@pytest.mark.slow
def test_a_converted_gguf_generates_the_dequantized_models_tokens(gguf_pair):
    kept, flat = gguf_pair
    q, f = jaxspec.load(kept, quantized=True), jaxspec.load(flat)
    assert jaxspec.generate(q, [[5, 9, 14]], max_new_tokens=8).tokens == (
        jaxspec.generate(f, [[5, 9, 14]], max_new_tokens=8).tokens
    )


def test_load_keeps_or_dequantizes_by_the_backends_default(gguf_pair):
    kept, _ = gguf_pair
    want = sys.modules["jaxspec.io.convert"].KEEP_QUANTIZED[jax.default_backend()]
    assert Q.is_quantized_model(jaxspec.load(kept)) == want
    assert not Q.is_quantized_model(jaxspec.load(kept, quantized=False))


def _two_way(kept):
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    return jaxspec.load(kept, quantized=True, mesh=mesh)


def test_a_quantized_checkpoint_loads_onto_a_tensor_parallel_mesh(gguf_pair):
    """Codes and scales restored straight into their shards, split alike (the engines' tests
    decode with such a mesh: test_quantized_engines.py)."""
    two = _two_way(gguf_pair[0])
    up = _pure(two)["layers"][0]["mlp"]["up_proj"]["kernel"]
    assert quant.is_quantized(up) and len(up.values.sharding.device_set) == 2
    assert up.values.sharding.spec == up.scales.sharding.spec == jax.P(None, "tp")
    assert up.mins.sharding.spec == jax.P(None, "tp")  # Q4_1's offsets too


@pytest.mark.slow
def test_a_quantized_checkpoint_on_a_mesh_generates_as_on_one_device(gguf_pair):
    one, two = jaxspec.load(gguf_pair[0], quantized=True), _two_way(gguf_pair[0])
    prompt = [[5, 9, 14, 3]]
    assert jaxspec.generate(two, prompt, max_new_tokens=8).tokens == (
        jaxspec.generate(one, prompt, max_new_tokens=8).tokens
    )


def test_an_unreadable_gguf_type_is_a_checkpoint_error(hf, tmp_path):
    src = write_gguf(hf, tmp_path / "bad.gguf", types={"blk.0.attn_q.weight": T.Q8_1})
    err = _fails(
        lambda: jaxspec.convert(src, tmp_path / "out", progress=False), tmp_path / "out", "Q8_1"
    )
    assert "blk.0.attn_q.weight" in str(err) and "Q4_1" in str(err)  # what it can use instead


def test_a_truncated_block_is_a_checkpoint_error_with_nothing_left(gguf_file, tmp_path):
    src = tmp_path / "cut.gguf"
    data = gguf_file.read_bytes()
    src.write_bytes(data[: len(data) - 100])  # inside the last tensor's blocks
    dst = tmp_path / "out" / "ckpt"
    _fails(lambda: jaxspec.convert(src, dst, progress=False), dst, "truncated|corrupt")


# ----------------------------------------------------------------------------- AWQ


@pytest.fixture(scope="module")
def awq(tmp_path_factory, hf):
    folder = tmp_path_factory.mktemp("awq") / "hf"
    return folder, write_awq(hf, folder, group=32)


def test_an_awq_layer_unpacks_and_dequantizes_as_autoawq_defines_it():
    """A random layer packed by AutoAWQ's definition (tests.hf_fixtures.awq_pack, written from
    WQLinear_GEMM.from_linear) reads back as its codes, and dequantizes to (q - z) * s."""
    rng = np.random.default_rng(0)
    k, n, g = 128, 48, 64
    codes = rng.integers(0, 16, (k, n), dtype=np.uint8)
    zeros = rng.integers(0, 16, (k // g, n), dtype=np.uint8)
    scales = rng.uniform(1e-3, 0.1, (k // g, n)).astype(np.float16)
    qweight, qzeros = awq_pack(codes), awq_pack(zeros)
    assert qweight.dtype == np.int32 and qweight.shape == (k, n // 8)
    np.testing.assert_array_equal(awq_io.unpack(qweight), codes)
    w = awq_io.weight(qweight, qzeros, scales, g)
    assert (w.shape, w.bits, w.group) == ((k, n), 4, g)
    want = (codes.astype(np.float32) - np.repeat(zeros, g, axis=0)) * np.repeat(
        scales.astype(np.float32), g, axis=0
    )
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), want)
    with pytest.raises(ValueError, match="not one AWQ weight"):
        awq_io.weight(qweight, qzeros, scales, 32)  # zeros / scales of another group size


def test_awq_weights_are_read_quantized_as_autoawq_defines_them(awq, tmp_path):
    """Each AWQ linear, read back, dequantizes to (q - z) * s of the codes the fixture packed
    by AutoAWQ's definition, bit for bit in float32; the model decodes as its float twin."""
    folder, parts = awq
    ckpt = jaxspec.convert(folder, tmp_path / "q", dtype="float32", progress=False)
    assert json.loads((ckpt / "config.json").read_text())["quantization"]["method"] == "awq"
    model = jaxspec.load(ckpt, quantized=True)
    pure = _pure(model)
    for module, (codes, zeros, scales) in parts.items():
        _, _, i, block, name = module.split(".")
        w = pure["layers"][int(i)][block][name]["kernel"]
        assert quant.is_quantized(w) and w.bits == 4 and w.group == 32
        s = np.repeat(scales.astype(np.float32), 32, axis=0)
        want = (codes.astype(np.float32) - np.repeat(zeros, 32, axis=0)) * s
        np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), want, err_msg=module)
    flat = jaxspec.load(
        jaxspec.convert(folder, tmp_path / "f", dtype="float32", quantize="none", progress=False)
    )
    tokens = np.arange(3, 30)[None]
    lq, lf = np.asarray(model.logits(tokens)), np.asarray(flat.logits(tokens))
    np.testing.assert_allclose(lq, lf, rtol=0, atol=1e-5 * np.abs(lf).max())


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(bits=8), "bits=8"),
        (dict(version="gemv"), "'gemv'"),
        (dict(quant_method="gptq"), "'gptq'"),
    ],
)
def test_awq_variants_jaxspec_cannot_read_are_checkpoint_errors(awq, tmp_path, change, match):
    folder, _ = awq
    src = tmp_path / "src"
    src.mkdir()
    for f in folder.iterdir():
        (src / f.name).symlink_to(f)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "out" / "ckpt"
    _fails(lambda: jaxspec.convert(src, dst, progress=False), dst, match)


# ----------------------------------------------------------------------------- int8 / int4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hf):
    folder = tmp_path_factory.mktemp("hf") / "hf"
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize(
    "bits, group", [pytest.param(8, None, marks=pytest.mark.slow), (4, 32)]
)  # int8's quantizer is int4's with 8 bits (test_quant_kernels.py checks both)
def test_convert_quantizes_a_float_checkpoint(hf_dir, tmp_path, bits, group):
    kw = {} if group is None else dict(group_size=group)
    ckpt = jaxspec.convert(
        hf_dir, tmp_path / "q", dtype="float32", quantize=f"int{bits}", progress=False, **kw
    )
    tensors = json.loads((ckpt / "config.json").read_text())["quantization"]["tensors"]
    assert len(tensors) == 2 * 7 + 1  # the projections and the tied embedding / LM head
    assert tensors["layers.0.mlp.down_proj.kernel"]["group"] == (group or 128)  # per channel
    q = jaxspec.load(ckpt, quantized=True)
    f = jaxspec.load(jaxspec.convert(hf_dir, tmp_path / "f", dtype="float32", progress=False))
    # what Orbax gave back is quant.quantize of the float weights, codes and scales to the bit
    # (an embedding quantized as [D, V]: a scale per vocabulary column serves the LM head)
    flat_f = dict(jax.tree_util.tree_leaves_with_path(_pure(f)))
    for path, w in jax.tree_util.tree_leaves_with_path(_pure(q), is_leaf=quant.is_quantized):
        if not quant.is_quantized(w):
            continue
        dense = flat_f[path]
        dense = dense.T if Q.path_name(tuple(k.key for k in path)) == "embed_tokens" else dense
        want = quant.quantize(dense, bits, group)
        np.testing.assert_array_equal(np.asarray(w.values), np.asarray(want.values), str(path))
        np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(want.scales), str(path))
    tokens = np.arange(3, 30)[None]
    lq, lf = np.asarray(q.logits(tokens)), np.asarray(f.logits(tokens))
    # near the float model (int4 of a random 64-wide model errs by ~half the logits' size: each
    # weight by ~10%, compounding over the embedding, two layers and the head); that the
    # quantized forward computes as its dequantized twin is test_quant_kernels.py's
    assert np.linalg.norm(lq - lf) < (0.05 if bits == 8 else 0.6) * np.linalg.norm(lf)


def test_a_group_size_that_does_not_divide_is_an_option_error(hf_dir, tmp_path):
    dst = tmp_path / "out" / "ckpt"
    err = _fails(
        lambda: jaxspec.convert(hf_dir, dst, quantize="int4", group_size=48, progress=False),
        dst, "does not divide", OptionError,
    )  # fmt: skip
    assert "32" in str(err)  # a size that does divide
    _fails(
        lambda: jaxspec.convert(hf_dir, dst, group_size=32, progress=False),
        dst,
        "applies to quantize='int8'",
        OptionError,
    )
    _fails(
        lambda: jaxspec.convert(hf_dir, dst, quantize="int3", progress=False),
        dst,
        "quantize must be",
        OptionError,
    )


def test_the_cli_converts_with_quantize_and_names_its_flags(hf_dir, tmp_path, capsys):
    from jaxspec.cli import main

    argv = ["convert", str(hf_dir)]
    assert main([*argv, str(tmp_path / "q"), "--quantize", "int4", "--group-size", "32"]) == 0
    meta = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert meta["method"] == "int4"
    assert {f["group"] for f in meta["tensors"].values()} == {32}
    capsys.readouterr()
    assert main([*argv, str(tmp_path / "b"), "--quantize", "int4", "--group-size", "48"]) == 2
    err = capsys.readouterr().err
    assert "--group-size 48" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()
    assert main([*argv, str(tmp_path / "c"), "--group-size", "32"]) == 2  # source: no groups
    assert "--group-size applies to --quantize 'int8'" in capsys.readouterr().err
