"""One process of the 2-process tests (tests/test_multihost.py): joins the job, runs the engines
on meshes over both processes, and writes what it got as JSON.

    python -m tests.multihost_worker COORDINATOR PROCESS_ID CASE CHECKPOINTS OUT

CASE ``engines``: a TP=4 target over both processes' devices (2 each) with autoregressive,
chain and tree decoding; then SwiftSpec with the target on process 0's devices and the draft on
process 1's. CASE ``hang``: joins, loads, then waits in a collective that the other process
never makes after it is killed (the test kills it).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import faulthandler  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from jaxspec import distributed, generate, load  # noqa: E402
from jaxspec.model.sharding import tp_mesh  # noqa: E402

NEW = 12
SHAPE = dict(depth=2, width=3, branch=2, bs=6)
PROMPTS = [[5, 9, 14, 3, 27, 9, 14, 3, 27, 40, 8], [11, 12], [60, 61, 62, 60, 61, 62, 7]]


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


def main(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(420, exit=True)
    coordinator, pid, case, ckpt, out = argv
    distributed.initialize(coordinator, 2, int(pid), timeout_s=30)
    result = engines(pathlib.Path(ckpt)) if case == "engines" else {}
    pathlib.Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
