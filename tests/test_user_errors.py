"""Every error a user can cause is a JaxspecError subclass with a message that says what to do,
through the Python API and through the CLI (printed, exit code 2)."""

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.api import generate
from jaxspec.errors import CheckpointError, DraftError, JaxspecError, OptionError, PromptError
from tests import hf_fixtures, tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    src = tmp_path_factory.mktemp("hf")
    hf_fixtures.save_hf_checkpoint("llama3.1", src, tokenizer=True)
    return jaxspec.convert(
        src, tmp_path_factory.mktemp("ck") / "m", dtype="float32", progress=False
    )


@pytest.fixture(scope="module")
def model(ckpt):
    return jaxspec.load(ckpt)


@pytest.mark.parametrize(
    "kwargs,exc,says",
    [
        (dict(prompts=""), PromptError, "empty"),
        (dict(prompts=["w3 w4", "   "]), PromptError, "prompt 1 is empty"),
        (dict(prompts=[]), PromptError, "no prompts"),
        (dict(prompts=[[]]), PromptError, "at least one token"),
        (dict(prompts=[[3, 10**6]]), PromptError, "outside the vocabulary"),
        (dict(prompts=[[-1, 3]]), PromptError, "outside the vocabulary"),
        (dict(prompts="w3 " * 3000), PromptError, "exceeds the model's context"),
        (dict(method="beam"), OptionError, "unknown method"),
        (dict(temperature=-1.0), OptionError, "temperature"),
        (dict(top_p=0.0), OptionError, "top_p"),
        (dict(top_k=-2), OptionError, "top_k"),
        (dict(max_new_tokens=0), OptionError, "max_new_tokens"),
        (dict(method="chain"), DraftError, "needs a draft"),
        (dict(method="chain", draft="medusa"), DraftError, "unknown draft"),
        (dict(method="chain", draft="ngram", gamma=0), OptionError, "gamma"),
        (dict(method="chain", draft="ngram", beams=2), OptionError, "does not take"),
        (dict(method="tree", draft="ngram", width=-1), OptionError, "width"),
        (dict(method="chain", draft="self-streaming", budget=8), OptionError, "window"),
        (dict(draft="ngram"), OptionError, "takes no draft"),
    ],
)
def test_generate_rejects_bad_input_with_a_clear_error(model, kwargs, exc, says):
    args = {"prompts": "w3 w4 w5", **kwargs}
    with pytest.raises(exc, match=says) as err:
        generate(model, args.pop("prompts"), **args)
    assert isinstance(err.value, JaxspecError)


def test_a_draft_with_another_vocabulary_is_refused(model):
    other = tiny.model(0, vocab_size=model.config.vocab_size + 1)
    with pytest.raises(DraftError, match="vocabulary"):
        generate(model, "w3 w4", draft=other, method="chain")


def test_prompts_as_text_need_a_tokenizer():
    with pytest.raises(PromptError, match="token ids"):
        generate(tiny.model(0), "hello")


def test_logits_rejects_ids_outside_the_vocabulary(model):
    with pytest.raises(PromptError, match="outside the vocabulary"):
        model.logits([[1, model.config.vocab_size]])


@pytest.mark.parametrize(
    "argv,says",
    [
        (["generate", ""], "empty"),
        (["generate", "w3", "--temperature", "-1"], "temperature"),
        (["generate", "w3", "--method", "chain"], "needs a draft"),
        (["generate", "w3", "--method", "chain", "--draft", "ngram", "--gamma", "0"], "gamma"),
        (["generate", "w3", "--method", "swiftspec", "--draft", "ngram"], "needs a draft model"),
    ],
)
def test_cli_prints_the_error_and_exits_2(ckpt, argv, says, capsys):
    code = cli.main([*argv, "--model", str(ckpt), "--raw", "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and says in err


def test_cli_missing_checkpoint_exits_2(tmp_path, capsys):
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "nope")]) == 2
    assert "error: " in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_cli_unknown_method_exits_2(ckpt):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "w3", "--model", str(ckpt), "--method", "beam"])
    assert e.value.code == 2


def test_cli_generates_and_reports_speed(ckpt, capsys):
    assert (
        cli.main(
            [
                "generate",
                "w3 w4 w5",
                "--model",
                str(ckpt),
                "--raw",
                "--max-new-tokens",
                "5",
                "--method",
                "chain",
                "--draft",
                "ngram",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "tokens/s" in out.err and "[chain]" in out.err and out.out.strip()


def test_convert_and_load_errors_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError):
        jaxspec.load(tmp_path)
    with pytest.raises(CheckpointError):
        jaxspec.convert(tmp_path / "missing", tmp_path / "out")


def test_the_public_api_is_importable_from_the_package(model):
    r = jaxspec.generate(model, "w3 w4 w5", max_new_tokens=3)
    assert isinstance(r, jaxspec.GenerationResult)
    assert len(r.tokens[0]) <= 3 and isinstance(r.text[0], str)
    assert r.stats["tokens_per_s"] > 0 and r.stats["acceptance_length"] == 1.0


@pytest.mark.parametrize(
    "var, value, says",
    [
        ("JAXSPEC_FUSED_LINEAR", "fast", "must be one of auto, off, pallas, interpret"),
        ("JAXSPEC_FUSED_COMMIT", "fast", "must be one of auto, off, pallas, interpret"),
        ("JAXSPEC_ATTENTION", "triton", "must be one of auto, reference, pallas, interpret"),
        ("JAXSPEC_PREFILL_CHUNK", "40", "multiple of 16"),
        ("JAXSPEC_MIN_GEMM_ROWS", "x", "non-negative integer"),
    ],
)
def test_cli_bad_kernel_variable_exits_2(ckpt, var, value, says, monkeypatch, capsys):
    """JAXSPEC_FUSED_LINEAR=fast (read by the CLI into its KernelConfig before any work) is an
    OptionError that names the variable and the choices: printed, exit 2."""
    monkeypatch.setenv(var, value)
    argv = ["generate", "w3", "--model", str(ckpt), "--raw", "--max-new-tokens", "4"]
    argv += ["--method", "tree", "--draft", "ngram"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and var in err and says in err


@pytest.mark.parametrize(
    "kernels, says",
    [
        (lambda: "reference", "kernels must be a jaxspec.KernelConfig"),
        (lambda: jaxspec.KernelConfig(fused_linear="fast"), "fused_linear must be one of"),
        (lambda: jaxspec.KernelConfig(prefill_chunk=40), "multiple of 16"),
        (lambda: jaxspec.KernelConfig(linear_tile=(48, 128, 4)), "linear_tile"),
    ],
)
def test_generate_rejects_a_bad_kernel_config(model, kernels, says):
    with pytest.raises(OptionError, match=says):
        generate(model, "w3 w4", kernels=kernels())


def test_a_gpu_kernel_on_another_backend_is_an_option_error(model):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("the GPU runs the kernel")
    with pytest.raises(OptionError, match="needs a GPU backend.*interpret"):
        generate(model, "w3 w4", kernels=jaxspec.KernelConfig(fused_attention="pallas"))
