"""Distillation data: the target writes the text it will teach from (``jaxspec.train.distill``).

Real prompts (``jaxspec.io.datasets``) decoded by the target's own batched autoregressive engine
(one greedy continuation, then sampled passes), documents concatenated and cut into windows;
the first ``HOLDOUT`` prompts of a set (the ones the benchmarks measure) are never used.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
import time

import numpy as np
from tqdm.auto import tqdm

from jaxspec.api import trim
from jaxspec.engines import autoregressive, base
from jaxspec.errors import CheckpointError, OptionError
from jaxspec.io import datasets
from jaxspec.io.draft_checkpoint import _fresh_dir, _read_json, _replace
from jaxspec.model.transformer import Model
from jaxspec.prompts import encode_prompts
from jaxspec.spec.sampling import Sampling

HOLDOUT = {"humaneval": 20}  # prompts the benchmarks use: never trained on


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """How the target writes the training text; ``resume`` reuses what was written."""

    data: tuple[str, ...] = ("humaneval", "chat")
    samples: int = 4  # temperature samples per prompt, besides the greedy continuation
    temperature: float = 0.8
    max_new: int = 256
    gen_batch: int = 64
    max_prompt_tokens: int = 512  # longer prompts keep their last tokens
    seed: int = 0


def _sources(spec: DataSpec) -> list[tuple[str, str, bool]]:
    """(name as given, dataset name, chat template?) per source."""

    is_chat = getattr(datasets, "chat_template", lambda n: n == "chat")
    out = []
    for item in spec.data:
        name, _, mode = item.partition("@")
        if mode not in ("", "chat", "raw"):
            raise OptionError(f"data source {item!r}: the suffix must be @chat or @raw.")
        out.append((item, name, is_chat(name) if not mode else mode == "chat"))
    return out


def _prompt_rows(target: Model, spec: DataSpec, prompts) -> tuple[list[list[int]], dict]:
    """Token ids of every training prompt, and a description of where they came from."""

    if prompts is not None:
        ids = encode_prompts(list(prompts), target.tokenizer, target.config)
        return ids, {"given": {"prompts": len(ids), "held_out": 0}}
    if target.tokenizer is None:
        raise OptionError(
            "the target has no tokenizer, so distill cannot encode dataset prompts; pass "
            "prompts= as lists of token ids."
        )
    rows, info = [], {}
    for item, name, chat in _sources(spec):
        texts, source = datasets.load(name)
        skip = HOLDOUT.get(name, 0)
        kept = texts[skip:]
        if not kept:
            raise OptionError(
                f"data source {item!r} has {len(texts)} prompts, all held out (the first {skip} "
                "are benchmark prompts); add another source."
            )
        ids = encode_prompts(kept, target.tokenizer, target.config, chat=chat)
        rows += ids
        info[item] = {"source": source, "prompts": len(ids), "held_out": skip, "chat": chat}
    return rows, info


def _width(target: Model, n: int, batch: int) -> int:
    """The padded prompt width ``pad_prompts`` would pick for ``batch`` rows: past one prefill
    chunk the width is a multiple of it."""
    chunk = target.net().kernels.prefill_tokens(batch)
    m = 16 if n <= chunk else chunk
    return -(-n // m) * m


def _decode_batch(target: Model, rows: list[list[int]], width: int, spec: DataSpec, temp, seed,
                  b: int):  # fmt: skip
    """One batch of ``b`` rows through the target's own autoregressive engine (the loop
    ``generate`` runs), padded to a fixed width so batches of a size reuse one compilation."""
    real = len(rows)
    rows = rows + [rows[-1]] * (b - real)
    ids = np.zeros((b, width), np.int32)
    lens = np.array([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    eos = tuple(target.config.eos_token_ids)
    req = base.Request(b, width, spec.max_new, Sampling(float(temp), 1.0, 0), eos)
    engine = autoregressive.ENGINE
    prog, _ = engine.program(target, None, autoregressive.Options(), req, None)
    r = engine.run(prog, target, None, ids, lens, int(seed))
    return trim(r.tokens, r.count)[:real], r.stats


class BatchSizes:
    """Rows per generation batch under a deadline. A batch is one on-device loop that cannot
    stop halfway (a 64-row batch of 256 new tokens took minutes on a CPU, past a 60 s budget), so
    the first batch is small and each next one as large as the time left allows, by the rate
    the last one measured: powers of two up to ``gen_batch`` (few sizes, few compiles). A batch
    predicted to end past the deadline does not start (the first one always does)."""

    def __init__(self, gen_batch: int, deadline: float | None):
        self.ladder = [min(gen_batch, 1 << i) for i in range(2, max(gen_batch, 4).bit_length() + 1)]
        self.ladder = sorted(set(self.ladder + [gen_batch]))
        self.deadline = deadline
        self.rate: float | None = None  # seconds per row, compile excluded
        self.compile_s = 0.0
        self.seen: set[int] = set()

    def next(self, done: list) -> int:
        if self.deadline is None:
            return self.ladder[-1]
        if self.rate is None:
            return self.ladder[0] if not done else 0
        left = self.deadline - time.perf_counter()
        fits = [r for r in self.ladder
                if r * self.rate + (0 if r in self.seen else self.compile_s) <= left]  # fmt: skip
        return fits[-1] if fits else 0

    def took(self, rows: int, seconds: float, compile_s: float) -> None:
        self.seen.add(rows)
        self.compile_s = max(self.compile_s, compile_s)
        self.rate = max(seconds - compile_s, 1e-6) / rows


def generate_data(
    target: Model,
    out_dir: pathlib.Path,
    spec: DataSpec,
    *,
    prompts=None,
    deadline: float | None = None,
    progress: bool = True,
) -> dict:
    """The target writes the training documents; saved atomically to ``out_dir``."""

    ids, info = _prompt_rows(target, spec, prompts)
    # a prompt and its continuation fit the context: longer prompts keep their last tokens
    cap = min(spec.max_prompt_tokens, target.config.max_position_embeddings - spec.max_new)
    ids = [p[-cap:] for p in ids]
    width = _width(target, max(len(p) for p in ids), spec.gen_batch)
    # pass 0: greedy; passes 1..samples: temperature. Ordered by pass, so a budget cut keeps
    # whole passes over every source.
    jobs = [(0, i) for i in range(len(ids))]
    jobs += [(s, i) for s in range(1, spec.samples + 1) for i in range(len(ids))]
    docs: list[np.ndarray] = []
    new_tokens = 0
    t0 = time.perf_counter()
    sizes = BatchSizes(spec.gen_batch, deadline)
    bar = tqdm(total=len(jobs), desc="target writes data", unit="doc", disable=not progress)
    stopped = False
    with bar:
        k = 0
        while k < len(jobs):
            rows_now = sizes.next(docs)
            if rows_now == 0:
                stopped = True
                break
            greedy = jobs[k][0] == 0
            chunk = []
            while k < len(jobs) and len(chunk) < rows_now and (jobs[k][0] == 0) == greedy:
                chunk.append(jobs[k])
                k += 1
            rows = [ids[i] for _, i in chunk]
            seed = spec.seed * 1_000_003 + k
            t_batch = time.perf_counter()
            # the bar moves only when a batch is done: say what the wait is (the first batch
            # also compiles; a 64-row batch of 128 tokens took minutes on 2 cores)
            what = "compiling, then writing" if k == len(chunk) else "writing"
            bar.set_postfix_str(
                f"{what} {len(chunk)} {'greedy' if greedy else 'sampled'} docs of up to "
                f"{spec.max_new} tokens", refresh=True,
            )  # fmt: skip
            new, stats = _decode_batch(
                target, rows, width, spec, 0.0 if greedy else spec.temperature, seed, rows_now
            )
            sizes.took(rows_now, time.perf_counter() - t_batch, stats.compile_s)
            for r, t in zip(rows, new, strict=True):
                docs.append(np.asarray(r + t, np.int32))
                new_tokens += len(t)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    stream = np.concatenate(docs)
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    meta = {
        "spec": _spec_json(spec),
        "sources": info,
        "documents": len(docs),
        "planned_documents": len(jobs),
        "stopped_by_budget": stopped,
        "tokens": int(stream.size),
        "generated_tokens": int(new_tokens),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    tmp = _fresh_dir(out_dir)
    try:
        np.save(tmp / "tokens.npy", stream)
        np.save(tmp / "offsets.npy", offsets)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _spec_json(spec: DataSpec) -> dict:
    d = dataclasses.asdict(spec)
    d["data"] = list(spec.data)
    return d


def _load_data(data_dir: pathlib.Path) -> tuple[np.ndarray, dict]:
    meta = _read_json(data_dir / "meta.json", "data description")
    try:
        stream = np.load(data_dir / "tokens.npy")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{data_dir / 'tokens.npy'} is unreadable ({e}).") from None
    return stream, meta


def _windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    n = stream.size // seq_len
    return stream[: n * seq_len].reshape(n, seq_len)


def _batch(windows: np.ndarray, position: int, batch: int, seed: int) -> np.ndarray:
    """Windows ``position .. position + batch`` of the epoch-wise shuffled order."""
    n = windows.shape[0]
    idx = []
    for g in range(position, position + batch):
        epoch, j = divmod(g, n)
        idx.append(_perm(n, seed, epoch)[j])
    return windows[np.asarray(idx)]


@functools.lru_cache(maxsize=8)
def _perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def source_counts(data_dir: pathlib.Path, stream: np.ndarray, meta: dict, vocab_size: int):
    """How often each token id occurs in the data (``stream``, the data folder's tokens), each
    source weighted equally: every source's counts scaled to the largest source's total (int32
    ``[vocab_size]``, at most int32's largest; one source: its plain counts). A draft's LM head
    is cut to the tokens counted most (``model.vocab_head``), and it must keep the tokens of
    every kind of text the draft serves: the shipped head's run had 2,859 stdlib prompts beside
    80 chat turns, and its plain counts cut at 4,096 tokens made it accept 1.60 tokens a
    verification on chat prompts where counts of HumanEval and chat text gave 1.83
    (benchmarks/notes/feature_draft.md). Weighted, on a CPU sample of that data (2026-12-07,
    checkpoints/README.md): chat 1.81 against 1.73 plain, HumanEval 3.34 against 3.36. Document
    ``d`` continues prompt ``d % prompts`` (the passes run over every prompt in turn), and the
    prompts are the sources' in order."""
    try:
        offsets = np.load(data_dir / "offsets.npy")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{data_dir / 'offsets.npy'} is unreadable ({e}).") from None
    sizes = [int(s["prompts"]) for s in meta["sources"].values()]
    which = np.searchsorted(np.cumsum(sizes), np.arange(len(offsets) - 1) % sum(sizes), "right")
    per_token = np.repeat(which, np.diff(offsets))
    counts = [np.bincount(stream[per_token == s], minlength=vocab_size) for s in range(len(sizes))]
    top = max(int(c.sum()) for c in counts)
    scaled = [c * (top / c.sum()) for c in counts if c.sum()]
    total = np.round(np.sum(scaled, axis=0))
    return np.minimum(total, np.iinfo(np.int32).max).astype(np.int32)
