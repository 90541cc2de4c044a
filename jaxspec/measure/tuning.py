"""Options an engine leaves open for measuring, chosen before its program is built.

``jaxspec.generate`` calls ``tune`` when ``Engine.open_choices`` names any: MagicDec's
``gamma="auto"`` / ``shape="auto"`` go to its cost model (``cost_model.tune``), SwiftSpec's
device split and d to its profile (``split.tune``). Each returns the options with the choice
filled in and a record of what was measured (kept in the run's ``stats.tuning``); measurements
are kept with the target model, so a second call with the same shapes measures nothing.
"""

from __future__ import annotations

from jaxspec.measure import cost_model, split


def tune(
    engine, target, draft, options, ids, lens, req, kernels, progress=None, profile_dir=None,
    streamed=False,
):  # fmt: skip
    """(options with the open choices made, what was chosen and from what). ``progress(message)``
    hears of each measurement before it starts; ``profile_dir`` keeps MagicDec's measurements
    for later processes (``measure.profiles``); ``streamed``: the call will be streamed (a
    measurement that runs the call's program runs its streamed programs)."""
    if engine.name == "magicdec":
        return cost_model.tune(
            target, draft, options, ids, lens, kernels, progress=progress, profile_dir=profile_dir,
            req=req, streamed=streamed,
        )  # fmt: skip
    if engine.name == "swiftspec":
        return split.tune(target, draft, options, ids, lens, req, kernels, progress=progress)
    raise NotImplementedError(f"{engine.name} leaves {engine.open_choices(options)} open")
