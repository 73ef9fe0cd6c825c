"""Command line: `python -m ftrain inspect|export|plot ...` (see `python -m ftrain -h`)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ftrain.checkpoint import (
    CheckpointError,
    Opened,
    latest_checkpoint,
    open_checkpoint,
    read_meta,
    step_dirs,
)
from ftrain.extras.hf_export import export_checkpoint


def inspect(
    path: Path, *, verify: bool = True, metric: str | None = None, mode: str | None = None
) -> int:
    """Print what a checkpoint (or a run folder of them) holds; return 0 when it (the newest) is
    complete and intact, else 1.

    The checks are `load_checkpoint`'s own (one validator): what this calls complete loads.
    `metric` and `mode` rank a run folder's checkpoints (default "eval_loss", "min").

    Raises:
        ValueError: for `metric` or `mode` given with a single checkpoint (nothing to rank),
            a `mode` other than "min" and "max", or `mode="max"` without `metric` (the
            default metric, eval_loss, is best when lowest).
    """
    if mode not in (None, "min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if _is_run_folder(path):
        if mode == "max" and metric is None:
            raise ValueError(_MAX_LOSS)
        return inspect_run(path, verify=verify, metric=metric or "eval_loss", mode=mode or "min")
    if (why := _unranked(path, metric=metric, mode=mode)) is not None:
        raise ValueError(why)
    print(f"checkpoint  {path}")
    try:
        opened = open_checkpoint(path, verify=verify, keep=())
    except CheckpointError as e:
        print(f"complete    no: {e}")
        if runs := _runs_inside(path):  # a folder of runs is not a checkpoint cut short
            print(f"            {path} is a folder of run folders: inspect one, e.g. {runs[0]}")
        return 1
    meta = opened.meta
    fields = meta["fields"]
    rows = meta["params"]
    trainable = sum(math.prod(r[2]) for r in rows if r[3] is True)
    total = sum(math.prod(r[2]) for r in rows)
    summed = all(entry.get("sha256") for entry in meta["files"].values())
    note = " (checksums verified)" if verify and summed else " (no checksums checked)"
    print(f"complete    yes{note}")
    print(f"step        {_value(fields, 'step')}")
    epoch, cursor = _value(fields, "epoch"), _value(fields, "data.cursor")
    print(f"epoch       {epoch}  (cursor {cursor} micro-batches)")
    tokens, samples = _value(fields, "data.tokens_seen"), _value(fields, "data.samples_seen")
    print(f"seen        {tokens} tokens, {samples} samples")
    print(f"parameters  {trainable:,} trainable of {total:,}")
    if (line := _weights_line(opened)) is not None:  # export asks which: --weights
        print(f"weights     {line}")
    for k, v in sorted(meta["metrics"].items()):
        print(f"metric      {k} = {v}")
    best = fields.get("early_stopping.best_metric")
    if best is not None:
        print(f"best        {best} at step {fields.get('early_stopping.best_step')}")
    layout = f", sharded into {len(meta['files'])} files" if meta.get("sharded") is True else ""
    print(f"ranks       {meta['world_size']}{layout}")
    versions = _short(meta.get("ftrain_version")), _short(meta.get("torch_version"))
    print(f"written by  ftrain {versions[0]}, torch {versions[1]}")
    return 0


# Without --metric the ranked metric is eval_loss: --mode max marked its highest as the best.
_MAX_LOSS = (
    "mode='max' without a metric ranks eval_loss, whose best is its lowest: the highest loss "
    "would be marked best; name the metric that is best when highest, e.g. --metric "
    "eval_accuracy --mode max"
)


def _unranked(path: Path, **flags: str | None) -> str | None:
    """Why ranking flags cannot act on `path` (one checkpoint, nothing to rank), else None."""
    given = [f"{k}={v!r}" for k, v in flags.items() if v is not None]
    if not given or _is_run_folder(path):
        return None
    return (
        f"{' and '.join(given)} rank the checkpoints of a run folder, but {path} is not one "
        "(no step-<N> folder inside); drop them, or inspect the run folder"
    )


def _ema_coverage(opened: Opened) -> tuple[int, int] | None:
    """(trainable parameters with an EMA average, trainable parameters), or None for a
    checkpoint without an EMA (`ft.optim.ema` inside a partition group averages some only)."""
    averages = opened.ema_averages
    if not averages:
        return None
    trainable = [r[0] for r in opened.meta["params"] if r[3] is True]
    return sum(n in averages for n in trainable), len(trainable)


def _weights_line(opened: Opened) -> str | None:
    """inspect's `weights` line: the sets of weights saved, and what `export --weights` takes."""
    coverage = _ema_coverage(opened)
    if coverage is None:
        return None
    covered, trainable = coverage
    if covered == trainable:
        return "live, and their EMA average (ft.optim.ema): export --weights ema|live"
    return (
        f"live, and EMA averages of {covered} of {trainable} trainable parameters (ft.optim.ema "
        "inside a partition group): export --weights live"
    )


def _weights_refused(opened: Opened, weights: str | None) -> str | None:
    """Why `export --weights` (or its absence) cannot act on this checkpoint, else None: the
    checks of `ft.export_checkpoint(weights=...)`, made before it runs so that they alone are
    usage errors."""
    coverage, path = _ema_coverage(opened), opened.path
    whole = coverage is not None and coverage[0] == coverage[1]
    if weights is None and whole:
        return (
            f"{path} was trained with ft.optim.ema: it holds the live weights and their EMA "
            "average, and which one to export is not guessed: pass --weights ema (the average, "
            "what evaluation inside swap_ema uses) or --weights live (the weights training "
            "goes on from)"
        )
    part = "" if coverage is None else f"{coverage[0]} of its {coverage[1]} trainable parameters"
    if weights is None and coverage is not None:
        return (
            f"{path} was trained with ft.optim.ema: it holds the live weights and EMA averages "
            f"of {part} (ft.optim.ema inside a partition group), and which to export is not "
            "guessed: pass --weights live (the averages would be mixed with live weights)"
        )
    if weights == "ema" and coverage is None:
        return (
            f"--weights ema, but {path} holds no EMA average (its optimizer was not wrapped in "
            "ft.optim.ema): export its weights as they are (--weights live)"
        )
    if weights == "ema" and not whole:
        return (
            f"--weights ema, but the EMA averages of {path} cover {part} (ft.optim.ema inside a "
            "partition group): the export would mix averaged and live weights; pass "
            "--weights live"
        )
    return None


def _value(fields: dict[str, Any], name: str) -> object:
    v = fields.get(name)
    return v.get("value") if isinstance(v, dict) else v


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _runs_inside(path: Path) -> list[Path]:
    """The run folders directly inside `path` (none when it cannot be listed)."""
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and _is_run_folder(p))
    except OSError:
        return []


def _is_run_folder(path: Path) -> bool:
    """A folder of `step-<N>` checkpoints rather than one checkpoint."""
    try:
        return bool(step_dirs(path))
    except OSError:
        return False  # reported by the checkpoint path, which says why


def inspect_run(
    path: Path, *, verify: bool = True, metric: str = "eval_loss", mode: str = "min"
) -> int:
    """List a run folder's checkpoints: step, complete or not, metrics, latest and best.

    Every checkpoint's marker and state.json are checked; the newest (the one
    `latest_checkpoint` returns, which a resume loads) is checked completely (files, sizes,
    checksums unless `verify=False`). Returns 0 when it is complete.
    """
    found = step_dirs(path)
    # The newest is the one a resume would take: latest_checkpoint's choice.
    try:
        newest = latest_checkpoint(path)
    except OSError as e:
        print(f"run         {path}: cannot read it: {e.strerror or e}")
        return 1
    rows: list[tuple[int, Path, dict[str, Any] | None, str]] = []
    for step, p in found:
        try:
            meta = open_checkpoint(p, verify=verify, keep=()).meta if p == newest else read_meta(p)
            rows.append((step, p, meta, "complete" if p == newest else "committed"))
        except CheckpointError as e:
            rows.append((step, p, None, f"incomplete: {e}"))
    good = [(s, m) for s, _, m, _ in rows if m is not None]
    latest = next((s for s, p, m, _ in rows if p == newest and m is not None), None)
    best = _best(good, metric, mode)
    print(f"run         {path}  ({len(rows)} checkpoints, {len(good)} readable)")
    for step, _, saved, status in rows:
        marks = [m for m, s in (("latest", latest), (f"best {metric}", best)) if s == step]
        metrics = " ".join(f"{k}={v}" for k, v in sorted((saved or {}).get("metrics", {}).items()))
        tag = f"  <- {', '.join(marks)}" if marks else ""
        print(f"step {step:<8} {status:<10} {metrics}{tag}")
    if best is None:
        print(f"best        no checkpoint records a finite {metric!r} (--metric NAME)")
    return 0 if latest is not None else 1


def _best(good: list[tuple[int, dict[str, Any]]], metric: str, mode: str) -> int | None:
    scored = [
        (float(v) if mode == "min" else -float(v), s)
        for s, m in good
        if isinstance(v := m["metrics"].get(metric), (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    ]
    return min(scored)[1] if scored else None  # ties go to the older checkpoint


def plot(path: Path, out: Path, *, metrics: Sequence[str] | None, mode: str) -> int:
    """Plot a JSONL log; report the lines skipped (count and numbers) on stderr; 0 when the
    PNG is written, 1 on an error."""
    from ftrain.extras.logging import plot_metrics

    bad: list[tuple[int, str]] = []
    try:
        written = plot_metrics(
            path, out, metrics=metrics, mode=mode, on_bad_line=lambda n, why: bad.append((n, why))
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if bad:
            print(_bad_lines(path, bad), file=sys.stderr)
    print(f"wrote {written}")
    return 0


def _bad_lines(path: Path, bad: list[tuple[int, str]], shown: int = 20) -> str:
    listed = ", ".join(f"line {n} ({why})" for n, why in bad[:shown])
    more = f", and {len(bad) - shown} more" if len(bad) > shown else ""
    return f"warning: skipped {len(bad)} bad line(s) of {path}: {listed}{more}"


def at_least(low: int) -> Callable[[str], int]:
    """An argparse `type=`: an int >= `low`, so that argparse's error names the flag
    (`argument --batch-size: must be an integer >= 1, got 0`). The examples' count flags use it.

    Example:
        >>> import argparse
        >>> from ftrain.extras.cli import at_least
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("--steps", type=at_least(1))
        >>> p.parse_args(["--steps", "3"]).steps
        3
    """

    def parse(text: str) -> int:
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return int(text)

    parse.__name__ = "int"  # argparse's message for a non-number: "invalid int value"
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ftrain",
        description=__doc__,
        epilog="exit status: 0 done; 1 a checkpoint incomplete, or a file or the export failed "
        "(one 'error:' line says why); 2 arguments that cannot act (with this usage text)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "inspect", help="print a checkpoint's step, metrics and completeness, or list a run's"
    )
    p.add_argument("checkpoint", type=Path, help="a step-<N> folder, or a run folder of them")
    p.add_argument("--no-verify", action="store_true", help="skip checking file checksums")
    p.add_argument("--metric", help="run folder: the metric ranking 'best' (eval_loss)")
    p.add_argument(
        "--mode", choices=["min", "max"], help="run folder: lower (default) or higher is best"
    )
    p = sub.add_parser("export", help="write a checkpoint as an HF model directory")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--to", type=Path, required=True, help="output directory")
    p.add_argument("--config", type=Path, help="config.json (or its directory); default: saved")
    p.add_argument(
        "--base", type=Path, help="pretrained model for parameters frozen in training (its config)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --to directory")
    p.add_argument(
        "--allow-other-base",
        action="store_true",
        help="export onto a --base whose frozen weights differ from those the checkpoint was "
        "trained on (refused by default)",
    )
    p.add_argument(
        "--weights",
        choices=["ema", "live"],
        help="a run trained with ft.optim.ema: export the EMA average (what evaluation inside "
        "swap_ema uses) or the live weights; required for such a run, never guessed",
    )
    p.add_argument(
        "--live-buffers",
        action="store_true",
        help="with --weights ema: take the live BatchNorm running statistics beside the "
        "average (ft.optim.ema does not average them; refused by default)",
    )
    p = sub.add_parser(
        "plot", help="draw loss, lr and grad norm (or --metrics) from a metrics.jsonl"
    )
    p.add_argument("metrics_file", type=Path, metavar="metrics", help="a metrics.jsonl log")
    p.add_argument("-o", "--out", type=Path, default=Path("curves.png"), help="PNG to write")
    p.add_argument(
        "--metrics",
        nargs="+",
        metavar="NAME",
        help="plot these logged values instead (e.g. eval_accuracy); the first one's best step "
        "is marked",
    )
    p.add_argument(
        "--mode", choices=["min", "max"], help="with --metrics: best is lowest (default)/highest"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plot":
        if not args.out.suffix:  # matplotlib would add ".png" and write another file than named
            parser.error(
                f"plot -o {args.out}: no file extension, so the image would be written to "
                f"{args.out}.png; name the file, e.g. -o {args.out}.png"
            )
        if args.mode == "max" and args.metrics is None:
            # Without --metrics the best step marked is eval_loss's, whose best is its lowest.
            parser.error(
                f"plot --mode {args.mode} ranks the first of --metrics; without --metrics the "
                "marked best is the lowest eval_loss: name the metric, e.g. --metrics "
                "eval_accuracy --mode max"
            )
        return plot(args.metrics_file, args.out, metrics=args.metrics, mode=args.mode or "min")
    if args.command == "inspect":
        why = _unranked(args.checkpoint, metric=args.metric, mode=args.mode)
        if why is not None:  # a flag that cannot act on this path: a usage error (status 2)
            parser.error(f"inspect --metric/--mode: {why}")
        if args.mode == "max" and args.metric is None:
            parser.error(f"inspect --mode max: {_MAX_LOSS}")
        return inspect(
            args.checkpoint, verify=not args.no_verify, metric=args.metric, mode=args.mode
        )
    if args.config is not None and args.base is not None:
        # export_checkpoint builds the model from --base (its own config.json) and would read
        # --config nowhere.
        parser.error(
            f"export: --config {args.config} and --base {args.base} together: the model is "
            "loaded from --base with the base's own config, so --config would be ignored; pass "
            "one of them"
        )
    if args.live_buffers and args.weights != "ema":
        parser.error(
            "export: --live-buffers without --weights ema: it takes the live running "
            "statistics beside the EMA average, so it would be ignored; drop it, or pass "
            "--weights ema"
        )
    if args.allow_other_base and args.base is None:
        # The model is built from the checkpoint's config: there is no other base to allow.
        parser.error(
            "export: --allow-other-base without --base: it allows exporting onto another base "
            "model, and without --base there is none (the model is built from the checkpoint's "
            "config), so it would be ignored; pass --base DIR, or drop --allow-other-base"
        )
    return _export(parser, args)


def _export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`export`: 0 when written; 1 with one `error:` line when the checkpoint, a file or the
    export fails; status 2 (usage) only for arguments that cannot act on this checkpoint."""
    newest = latest_checkpoint(args.checkpoint) if _is_run_folder(args.checkpoint) else None
    if newest is not None:  # one checkpoint exports; a run folder holds several
        print(
            f"error: {args.checkpoint} is a run folder (step-<N> checkpoints inside), not a "
            f"checkpoint: export one of them, e.g. {newest} (the newest committed one); "
            "`python -m ftrain inspect` lists them",
            file=sys.stderr,
        )
        return 1
    # A run folder without a committed checkpoint: open_checkpoint says so, naming its folders.
    try:
        # The --weights checks before the export: they alone are usage errors, and a ValueError
        # from further in (transformers reading --base) is not one.
        opened = open_checkpoint(args.checkpoint, verify=False, keep=())
        if (why := _weights_refused(opened, args.weights)) is not None:
            parser.error(f"export: {why}")
        out = export_checkpoint(
            args.checkpoint,
            args.to,
            config=args.config,
            base=args.base,
            overwrite=args.overwrite,
            weights=args.weights,
            allow_other_base=args.allow_other_base,
            live_buffers=args.live_buffers,
        )
    except (CheckpointError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        if runs := _runs_inside(args.checkpoint):  # not a checkpoint, nor a run folder
            print(
                f"       {args.checkpoint} is a folder of run folders: export a checkpoint of "
                f"one of them, e.g. of {runs[0]}",
                file=sys.stderr,
            )
        return 1
    except (OSError, ValueError) as e:  # e.g. loading --base, writing --to: not a usage error
        print(
            f"error: export of {args.checkpoint} failed: {type(e).__name__}: {e}", file=sys.stderr
        )
        return 1
    which = {"ema": " (the EMA weights)", "live": " (the live weights)"}.get(args.weights, "")
    print(f"exported {args.checkpoint}{which} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
