"""Command line: `python -m ftrain inspect|export|plot ...` (see `python -m ftrain -h`)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from ftrain.checkpoint import CheckpointError, _sharded, export_checkpoint, read_meta
from ftrain.checkpoint import _layout as L
from ftrain.checkpoint._io import read_safetensors


def inspect(path: Path, *, verify: bool = True) -> int:
    """Print what a checkpoint holds; return 0 when it is complete and intact, else 1."""
    print(f"checkpoint  {path}")
    try:
        meta = read_meta(path)
        sharded = meta.get("sharded") is True
        if sharded:
            _sharded.verify(path, meta, checksum=verify)
        elif verify:
            for name in (L.MODEL_FILE, L.OPTIM_FILE):
                read_safetensors(path / name, sha256=meta["files"][name].get("sha256"))
    except CheckpointError as e:
        print(f"complete    no: {e}")
        return 1
    fields = meta["fields"]

    def value(name: str) -> object:
        v = fields.get(name)
        return v.get("value") if isinstance(v, dict) else v

    rows = meta["params"]
    trainable = sum(math.prod(r[2]) for r in rows if r[3] is True)
    total = sum(math.prod(r[2]) for r in rows)
    summed = all(entry.get("sha256") for entry in meta["files"].values())
    note = " (checksums verified)" if verify and summed else " (no checksums checked)"
    print(f"complete    yes{note}")
    print(f"step        {value('step')}")
    print(f"epoch       {value('epoch')}  (cursor {value('cursor')} micro-batches)")
    print(f"seen        {value('tokens_seen')} tokens, {value('samples_seen')} samples")
    print(f"parameters  {trainable:,} trainable of {total:,}")
    for k, v in sorted(meta["metrics"].items()):
        print(f"metric      {k} = {v}")
    if fields.get("best_metric") is not None:
        print(f"best        {fields['best_metric']} at step {fields.get('best_step')}")
    layout = f", sharded into {len(meta['files'])} files" if sharded else ""
    print(f"ranks       {meta['world_size']}{layout}")
    print(f"written by  ftrain {meta.get('ftrain_version')}, torch {meta.get('torch_version')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print a checkpoint's step, metrics and completeness")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--no-verify", action="store_true", help="skip checking file checksums")
    p = sub.add_parser("export", help="write a checkpoint as an HF model directory")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--to", type=Path, required=True, help="output directory")
    p.add_argument("--config", type=Path, help="config.json (or its directory); default: saved")
    p.add_argument("--base", type=Path, help="pretrained model for parameters frozen in training")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --to directory")
    p = sub.add_parser("plot", help="draw loss, lr and grad norm from a metrics.jsonl")
    p.add_argument("metrics", type=Path)
    p.add_argument("-o", "--out", type=Path, default=Path("curves.png"), help="PNG to write")
    args = parser.parse_args(argv)
    if args.command == "plot":
        from ftrain.logging import plot_metrics

        try:
            print(f"wrote {plot_metrics(args.metrics, args.out)}")
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "inspect":
        return inspect(args.checkpoint, verify=not args.no_verify)
    try:
        out = export_checkpoint(
            args.checkpoint, args.to, config=args.config, base=args.base, overwrite=args.overwrite
        )
    except (CheckpointError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
