"""SwiftSpec over N devices with the explicit tensor-parallel step: the target over x devices,
the draft over y, exact greedy tokens on the x + y layouts of 4, 6 and 8 devices; the split
chooser times that step and reports the tensor-parallel scaling it measured."""

import dataclasses

import numpy as np
import pytest

from jaxspec import KernelConfig
from jaxspec.api import generate
from jaxspec.engines import base
from jaxspec.engines.swiftspec import engine as swiftspec
from jaxspec.measure import split
from jaxspec.model import tensor_parallel
from jaxspec.spec.sampling import Sampling
from tests import tiny

TP = KernelConfig(tensor_parallel="shard_map")
SHAPE = dict(depth=2, width=3, branch=2, bs=6)
NEW = 16


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2), (4, 2), (6, 2)])
def test_swiftspec_with_a_tensor_parallel_target_is_greedy_equal_on_n_devices(layout):
    x, y = layout
    target = tiny.model(0, **tiny.TP)  # 24 / 12 heads, 48 MLP columns, 72 tokens: 6 divides
    ps = tiny.prompts(0, lengths=(23, 3, 11), vocab=tiny.TP["vocab_size"])
    ref = generate(target, ps, max_new_tokens=NEW).tokens
    draft = tiny.perturbed(target, 0.3, 0)
    kw = dict(target_devices=x, draft_devices=y, **SHAPE)
    r = generate(target, ps, draft=draft, method="swiftspec", max_new_tokens=NEW, kernels=TP, **kw)
    assert r.tokens == ref
    assert (r.stats["target_devices"], r.stats["draft_devices"]) == layout
    # both workers ran the explicit step, each over its own mesh
    req = base.Request(3, 32, NEW, Sampling(), ())
    prog, setup = swiftspec.ENGINE.program(target, draft, swiftspec.Options(**kw), req, TP)
    nets = (prog.workers.target, prog.workers.draft.net)
    assert all(tensor_parallel.active(net) for net in nets)
    assert [net.tp.degree for net in nets] == [x, y]
    devices = [{d.id for d in m.flat[0].sharding.device_set} for m in (setup.target, setup.draft)]
    assert devices == [set(range(x)), set(range(x, x + y))]


@pytest.mark.slow
def test_split_chooser_times_the_tensor_parallel_step_and_reports_its_scaling():
    """With the split and d open, the profile times every split through the explicit step
    (its Profile says so) and the run reports t_verify(1) / t_verify(x) for each x."""
    # 2 KV heads and 70 tokens: the target splits over 1 or 2 devices; a draft of one KV head
    # and 7 heads stays on one
    target = tiny.model(3, num_heads=4, num_kv_heads=2, vocab_size=70)
    draft = tiny.model(4, num_heads=7, num_kv_heads=1, head_dim=4, vocab_size=70)
    ps = tiny.prompts(3, lengths=(9, 4), vocab=70)
    r = generate(target, ps, draft=draft, method="swiftspec", max_new_tokens=8, kernels=TP,
                 width=2, branch=2, bs=4)  # fmt: skip
    assert r.tokens == generate(target, ps, max_new_tokens=8).tokens
    scaling = r.stats["tp_scaling"]
    assert set(scaling) == {1, 2} and scaling[1] == 1.0 and scaling[2] > 0
    profiled = r.stats["profiled"]
    assert profiled["tensor_parallel"] == ("shard_map" if profiled["target_devices"] > 1 else "")
    two = split.measure(target, draft, ps[0], (2, 1), width=2, branch=2, bs=4, kernels=TP)
    assert two.tensor_parallel == "shard_map" and two.d >= 1


def test_tp_scaling_takes_the_fastest_verify_of_each_target_degree():
    p = split.Profile(1, 1, 4.0, 1.0, 0.1, 4)
    rows = [p, dataclasses.replace(p, target_devices=2, t_verify_ms=2.5),
            dataclasses.replace(p, target_devices=2, draft_devices=2, t_verify_ms=2.0)]  # fmt: skip
    assert split.tp_scaling(rows) == {1: 1.0, 2: 2.0}
    assert split.tp_scaling(rows[1:]) == {}
    assert np.isfinite(rows[0].iteration_ms)
