"""One process of the 2-process tests (tests/test_multihost.py): joins the job, runs the
engines on meshes over both processes, and writes what it got as JSON.

    python -m tests.multihost_worker CASE COORDINATOR PROCESS_ID FOLDER OUT [TIMEOUT]

FOLDER holds the two tiny checkpoints (``write_checkpoints``). CASE ``job``, all in one job (each
process compiles every program once, the dearest part of these tests):

1. a TP=4 target over both processes' devices (2 each) with autoregressive, chain and tree
   decoding; then SwiftSpec with the target on process 0's devices and the draft on process 1's;
2. process 0 loads the target where process 1 loads the draft: a ``CheckpointError`` in both;
3. OUT is written (the results), and process 1 waits to be killed while process 0 waits in a
   check that process 1 never reaches: its ``WorkerError`` (or JAX's abort) is the test's.

CASE ``processes``: process 1 says the job has 3 processes. A ``JaxspecError`` (a
``WorkerError`` among them) is added to OUT as ``"error": [type, message]`` (exit code 2).
"""

import os
import sys

if __name__ == "__main__":  # imported by the test for its constants: the test's own devices stay
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"

import faulthandler  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from jaxspec import CheckpointError, JaxspecError, distributed, generate, load  # noqa: E402
from jaxspec.model.sharding import tp_mesh  # noqa: E402

NEW = 12
SHAPE = dict(depth=2, width=3, branch=2, bs=6)
PROMPTS = [[5, 9, 14, 3, 27, 9, 14, 3, 27, 40, 8], [11, 12], [60, 61, 62, 60, 61, 62, 7]]
VOCAB = 64  # 4 kv heads and 64 rows: a TP degree of 4 divides every split dimension


def write_checkpoints(folder: pathlib.Path) -> None:
    """A tiny random target and a perturbed copy (the draft) as converted checkpoints, with a
    word-level tokenizer (``w3 w4 ...``) so that the command line can run them. The test calls
    it in its own process (no JAX job there)."""
    import transformers
    from flax import nnx
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxspec.io.convert import _save_params
    from tests import tiny

    target = tiny.model(0, num_kv_heads=4, vocab_size=VOCAB)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    for name, m in (("target", target), ("draft", tiny.perturbed(target, 0.05, 1))):
        (folder / name).mkdir(parents=True)
        _save_params(folder / name / "params", nnx.to_pure_dict(m.params))
        meta = {**json.loads(m.config.to_json()), "dtype": "float32"}
        (folder / name / "config.json").write_text(json.dumps(meta))
        fast.save_pretrained(str(folder / name / "tokenizer"))


def engines(ckpt: pathlib.Path, out: dict) -> None:
    everywhere = tp_mesh(jax.devices())
    target = load(ckpt / "target", mesh=everywhere)
    out["devices"] = [d.id for d in jax.devices()]
    out["local"] = [d.id for d in jax.local_devices()]
    for method, kw in (
        ("autoregressive", {}),
        ("chain", dict(draft="ngram", gamma=3)),
        ("tree", dict(draft="ngram", depth=3)),
    ):
        out[method] = generate(target, PROMPTS, method=method, max_new_tokens=NEW, **kw).tokens
    out["target_devices"] = sorted(d.id for d in target.params["norm"]["weight"][...].devices())
    first, second = jax.devices()[:2], jax.devices()[2:]
    t = load(ckpt / "target", mesh=tp_mesh(first))
    d = load(ckpt / "draft", mesh=tp_mesh(second))
    r = generate(
        t, PROMPTS, draft=d, method="swiftspec", max_new_tokens=NEW, target_devices=2,
        draft_devices=2, **SHAPE,
    )  # fmt: skip
    out["swiftspec"] = r.tokens
    out["swiftspec_split"] = [r.stats["target_devices"], r.stats["draft_devices"]]


def other_checkpoints(ckpt: pathlib.Path) -> list[str] | None:
    """Process 0 loads the target, process 1 the draft: the error each gets (None: none)."""
    try:
        load(ckpt / ("target" if jax.process_index() == 0 else "draft"))
    except CheckpointError as e:
        return [type(e).__name__, str(e)]
    return None


def killed(result: dict) -> None:
    """Process 1 waits to be killed; process 0 waits in a check that it never reaches."""
    if jax.process_index() == 1:
        time.sleep(3600)  # the test kills this process here
    start = time.monotonic()
    try:
        distributed.agree("the step after the kill", "x")  # process 1 never gets there
    finally:
        result["waited_s"] = time.monotonic() - start


def job(ckpt: pathlib.Path, out: pathlib.Path, result: dict) -> None:
    engines(ckpt, result)
    result["checkpoint_error"] = other_checkpoints(ckpt)
    write(out, result)  # the test reads the results here, then kills process 1
    killed(result)


def write(out: pathlib.Path, result: dict) -> None:
    """OUT whole or not at all (the test reads it while this process runs)."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


def main(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(300, exit=True)
    jax.config.update("jax_default_matmul_precision", "highest")  # as the tests' conftest
    case, coordinator, pid, ckpt, out = argv[:5]
    timeout = float(argv[5]) if len(argv) > 5 else 30.0
    pid, ckpt, out = int(pid), pathlib.Path(ckpt), pathlib.Path(out)
    n = 3 if case == "processes" and pid == 1 else 2
    result: dict = {}
    try:
        distributed.initialize(coordinator, n, pid, timeout_s=timeout)
        if case == "job":
            job(ckpt, out, result)
    except JaxspecError as e:
        result["error"] = [type(e).__name__, str(e)]
        write(out, result)
        return 2
    write(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
