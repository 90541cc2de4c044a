"""One process of the 2-process tests (tests/test_multihost.py) and of
benchmarks/bench_multihost.py: joins the job, runs the engines on meshes over both processes,
and writes what it got as JSON.

    python -m tests.multihost_worker write FOLDER            # the two tiny checkpoints
    python -m tests.multihost_worker CASE COORDINATOR PROCESS_ID FOLDER OUT [TIMEOUT]

CASE ``engines``: a TP=4 target over both processes' devices (2 each) with autoregressive,
chain and tree decoding; then SwiftSpec with the target on process 0's devices and the draft on
process 1's. CASE ``killed``: both join and load; process 1 writes OUT and waits to be killed,
process 0 then waits in a check that process 1 never joins. CASE ``processes``: process 1 says
the job has 3 processes; CASE ``checkpoint``: process 1 loads the draft where process 0 loads
the target: either is an error in both processes, naming what differs. A ``JaxspecError`` (a
``WorkerError`` among them) is written to OUT as ``{"error": [type, message]}`` (exit code 2).
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

from jaxspec import JaxspecError, distributed, generate, load  # noqa: E402
from jaxspec.model.sharding import tp_mesh  # noqa: E402

NEW = 12
SHAPE = dict(depth=2, width=3, branch=2, bs=6)
PROMPTS = [[5, 9, 14, 3, 27, 9, 14, 3, 27, 40, 8], [11, 12], [60, 61, 62, 60, 61, 62, 7]]
VOCAB = 64  # 4 kv heads and 64 rows: a TP degree of 4 divides every split dimension


def write_checkpoints(folder: pathlib.Path) -> None:
    """A tiny random target and a perturbed copy (the draft) as converted checkpoints, with a
    word-level tokenizer (``w3 w4 ...``) so that the command line can run them."""
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


def engines(ckpt: pathlib.Path) -> dict:
    everywhere = tp_mesh(jax.devices())
    target = load(ckpt / "target", mesh=everywhere)
    out = {"devices": [d.id for d in jax.devices()], "local": [d.id for d in jax.local_devices()]}
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
    return out


def killed(ckpt: pathlib.Path, out: pathlib.Path) -> dict:
    load(ckpt / "target", mesh=tp_mesh(jax.devices()))
    if jax.process_index() == 1:
        out.write_text(json.dumps({"joined": True}))
        time.sleep(3600)  # the test kills this process here
    start = time.monotonic()
    distributed.agree("the step after the kill", "x")  # process 1 never gets there
    return {"waited_s": time.monotonic() - start}


def main(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(420, exit=True)
    jax.config.update("jax_default_matmul_precision", "highest")  # as the tests' conftest
    if argv[0] == "write":
        write_checkpoints(pathlib.Path(argv[1]))
        return 0
    case, coordinator, pid, ckpt, out = argv[:5]
    timeout = float(argv[5]) if len(argv) > 5 else 30.0
    pid, ckpt, out = int(pid), pathlib.Path(ckpt), pathlib.Path(out)
    n = 3 if case == "processes" and pid == 1 else 2
    try:
        distributed.initialize(coordinator, n, pid, timeout_s=timeout)
        if case == "engines":
            result = engines(ckpt)
        elif case == "killed":
            result = killed(ckpt, out)
        else:  # "processes" never gets here; "checkpoint" fails here
            result = {"loaded": load(ckpt / ("target" if pid == 0 else "draft")).name}
    except JaxspecError as e:
        out.write_text(json.dumps({"error": [type(e).__name__, str(e)]}))
        return 2
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
