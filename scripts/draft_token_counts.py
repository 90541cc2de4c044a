"""Give draft folders the token counts ``load_draft`` cuts their LM head with.

A draft distilled by this jaxspec has ``token_counts.npy`` already (its distill data's, each
source weighted equally); this counts the tokens of a distill data folder the same way and
writes them into drafts distilled before, such as the shipped ones (``checkpoints/README.md``):

    python scripts/draft_token_counts.py --data /tmp/draft-data \\
        checkpoints/drafts/smollm2-135m-instruct-draft \\
        checkpoints/drafts/smollm2-135m-instruct-feature

``--data`` is a distill data folder (``jaxspec distill``'s ``OUT/data``); when it is absent the
embedded default model writes it first: greedy continuations (``--new`` tokens) of the distill
prompt sets, their held-out prompts left out (``jaxspec.train.data``; minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxspec.errors import JaxspecError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafts", nargs="+", help="draft folders to give the counts to")
    ap.add_argument("--data", required=True, help="a distill data folder (written if absent)")
    ap.add_argument("--new", type=int, default=128, help="new tokens a prompt, when writing")
    args = ap.parse_args(argv)
    from jaxspec.io.draft_checkpoint import _read_json, write_token_counts
    from jaxspec.train.data import DataSpec, _load_data, generate_data, source_counts

    data = pathlib.Path(args.data).expanduser().absolute()
    try:
        if not (data / "meta.json").is_file():
            from jaxspec import load
            from jaxspec.io.default_model import default_checkpoint

            spec = DataSpec(samples=0, max_new=args.new)
            generate_data(load(default_checkpoint()), data, spec)
        stream, meta = _load_data(data)
        sources = ", ".join(meta["sources"])  # as run: "given" for prompts passed in
        source = (
            f"{meta['documents']} documents of {sources} (prompts and the target's greedy "
            f"continuations, {meta['spec']['max_new']} new tokens; held-out prompts left out): "
            f"{meta['tokens']} tokens"
        )
        source += ", each source's counts scaled to the largest source's total"
        for d in args.drafts:
            vocab = _read_json(pathlib.Path(d) / "draft.json", "draft description")["config"]
            vocab = int(vocab["vocab_size"])
            counts = write_token_counts(d, source_counts(data, stream, meta, vocab), source)
            print(f"{d}: counts of {counts.sum()} tokens, {(counts > 0).sum()} distinct")
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
