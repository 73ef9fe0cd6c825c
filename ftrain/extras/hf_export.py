"""export_pretrained: a directory `from_pretrained` loads, written atomically.

HF models and PEFT models export through their own `save_pretrained` (safetensors); a PEFT model
writes only its adapter, which `PeftModel.from_pretrained` loads on top of the base model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ftrain.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    Opened,
    base_differences,
    open_checkpoint,
    read_model_tensors,
    step_dirs,
    write_atomically,
)
from ftrain.optim import EmaState, ema_swapped, swap_ema
from ftrain.state import TrainState

__all__ = ["export_checkpoint", "export_pretrained"]


def export_pretrained(
    state: TrainState,
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
    merge: bool = False,
    weights: Literal["live", "ema"] | None = None,
    live_buffers: bool = False,
) -> Path:
    """Write the state's model so that `from_pretrained(directory)` loads it.

    A `transformers.PreTrainedModel` is saved with its config; a PEFT model saves its adapter
    (load it with `PeftModel.from_pretrained(base, directory)`); any other module is saved as
    `model.safetensors` (load it with `safetensors.torch.load_model`). The directory appears
    complete or not at all.

    Args:
        state: the state to export (not consumed).
        directory: where to write; must not exist unless `overwrite`.
        tokenizer: also saved into `directory` when given.
        overwrite: replace an existing `directory`.
        merge: for a PEFT (LoRA) model, write a full model with the adapters merged into a
            copy of the base weights (`merge_and_unload`), which `from_pretrained` loads
            without peft. The copy costs the model's memory once more while it is written.
        weights: for a state trained with `ft.optim.ema`, which weights to write: "ema" the
            average, "live" the weights training goes on from. Not guessed (as `python -m
            ftrain export --weights`): such a state needs it, except inside
            `ft.optim.swap_ema(state)`, where the model holds the average and that is written
            (None or "ema"). A state without an average has only its live weights (None or
            "live").
        live_buffers: with `weights="ema"`, write the live running statistics (BatchNorm's)
            beside the average, which `ft.optim.ema` does not average: such a model is
            refused without it, as `swap_ema(state, live_buffers=True)` takes them.

    Returns:
        `directory` as a Path.

    Raises:
        FileExistsError: if `directory` exists and `overwrite` is False.
        ValueError: `merge=True` on a model without adapters, a 4-/8-bit quantized base
            (merge into a full-precision base instead), or sharded (FSDP) parameters; an EMA
            state without `weights` outside `swap_ema`, `weights="ema"` without an average
            (or with an `ema` inside another optimizer: `swap_ema` swaps a top-level one),
            `weights="live"` inside `swap_ema`; `weights="ema"` of a model with running
            statistics without `live_buffers=True`, and `live_buffers=True` without
            `weights="ema"`.

    With several ranks, rank 0 writes and the others return at once. With FSDP call it on every
    rank: the sharded parameters are gathered first (a collective), and every rank returns once
    rank 0 has written the directory.
    """
    if _needs_swap(state, weights, live_buffers):
        with swap_ema(state, live_buffers=live_buffers):
            return export_pretrained(
                state, directory, tokenizer=tokenizer, overwrite=overwrite, merge=merge,
                weights="ema", live_buffers=live_buffers,
            )  # fmt: skip
    module, strategy = state.strategy.unwrap(state.model), state.strategy
    directory = Path(directory)
    # A sharded state is gathered by every rank together; then they leave together.
    together = strategy.checkpoint_sharded
    if merge:
        module = _merged(module, sharded=together)
    full = strategy.full_state_dict(module) if together else None
    try:
        if strategy.process_rank == 0:
            _refuse_replacing_checkpoints(directory, overwrite)
            write = lambda tmp: _save_module(module, tmp, tokenizer, full)  # noqa: E731
            write_atomically(directory, write, overwrite=overwrite)
    finally:
        if together:
            strategy.barrier()
    return directory


def _refuse_replacing_checkpoints(directory: Path, overwrite: bool) -> None:
    """Refuse to replace a checkpoint, a run folder or a folder holding either at any depth
    with an export (`overwrite=True` with the run folder as the target deleted every checkpoint
    in it; with a sweep's folder, `sweep/run-a/step-<N>`, every run of the sweep)."""
    if not overwrite or not directory.is_dir():
        return
    what = _holds_checkpoints(directory)
    if what is None:
        runs = (_holds_checkpoints(p) for p in directory.iterdir() if p.is_dir())
        what = "a folder of runs" if any(runs) else None
    if what is None and (deeper := _checkpoint_below(directory)) is not None:
        what = f"a folder holding checkpoints ({deeper})"
    if what is not None:
        raise ValueError(
            f"overwrite=True would replace {directory}, which is {what}, with the export "
            "(deleting it): export to a directory of its own"
        )


def _checkpoint_below(directory: Path) -> Path | None:
    """The first checkpoint folder found anywhere below `directory` (symlinks not followed:
    replacing the directory deletes what is inside it, not what a link points to), or None."""
    for folder, _, files in os.walk(directory):
        if "state.json" in files or "COMMITTED" in files:
            return Path(folder)
    return None


def _holds_checkpoints(directory: Path) -> str | None:
    if (directory / "state.json").exists() or (directory / "COMMITTED").exists():
        return "a checkpoint"
    return "a run folder of step-<N> checkpoints" if step_dirs(directory) else None


def _check_weights(caller: str, weights: str | None, live_buffers: bool) -> None:
    """Refuse a `weights` that names no set, and `live_buffers` where it would be ignored."""
    if weights not in (None, "live", "ema"):
        raise ValueError(f"weights must be 'ema', 'live' or None, got {weights!r}")
    if not isinstance(live_buffers, bool):
        raise TypeError(f"live_buffers must be True or False, got {live_buffers!r}")
    if live_buffers and weights != "ema":
        raise ValueError(
            f"{caller} got live_buffers=True with weights={weights!r}: it takes the live "
            "running statistics beside the EMA average, so it means something with "
            "weights='ema' only (the live weights export their own statistics)"
        )


def _needs_swap(state: TrainState, weights: str | None, live_buffers: bool) -> bool:
    """Whether the average must be swapped in to write `weights`; refuses a guess."""
    _check_weights("export_pretrained", weights, live_buffers)
    if ema_swapped(state):  # the model holds the average
        if weights == "live":
            raise ValueError(
                "export_pretrained(weights='live') inside ft.optim.swap_ema(state): the model "
                "holds the EMA average until the block ends; export the live weights outside it"
            )
        return False
    top = isinstance(state.opt_state, EmaState)
    if weights is None and _holds_ema(state.opt_state):
        raise ValueError(
            "export_pretrained: the state was trained with ft.optim.ema and holds two sets of "
            "weights; which one to write is not guessed: pass weights='ema' (the average, what "
            "evaluation inside swap_ema uses) or weights='live' (the weights training goes on "
            "from)"
        )
    if weights == "ema" and not top:
        raise ValueError(
            "export_pretrained(weights='ema'): "
            + ("the state's EMA sits inside another optimizer (a partition group?), and "
               "would cover some parameters only" if _holds_ema(state.opt_state)
               else "the state holds no EMA average (its optimizer is not ft.optim.ema(...))")
            + "; export weights='live'"
        )  # fmt: skip
    if weights == "ema" and not live_buffers:
        _refuse_running_stats(state)
    return weights == "ema"


def _refuse_running_stats(state: TrainState) -> None:
    """Refuse what `swap_ema` refuses, naming export_pretrained's argument: the average beside
    the running statistics of the live weights (BatchNorm's), which ft.optim.ema does not
    average."""
    model = state.strategy.unwrap(state.model)
    stats = [
        f"{prefix}.{b}" if prefix else b
        for prefix, m in model.named_modules()
        if getattr(m, "track_running_stats", False) is True
        for b in ("running_mean", "running_var")
        if isinstance(getattr(m, b, None), torch.Tensor)
    ]
    if stats:
        raise ValueError(
            f"export_pretrained(weights='ema'): ft.optim.ema averages the parameters, not the "
            f"buffers, and the model's running statistics {stats[:4]} are the live weights' "
            "(timm's ModelEmaV2 averages them): the averaged model would normalise with them. "
            "Pass live_buffers=True to export them anyway, or recompute them for the average "
            "inside swap_ema(state, live_buffers=True) (torch.optim.swa_utils.update_bn) and "
            "export there"
        )


def _holds_ema(tree: Any, depth: int = 0) -> bool:
    """Whether an optimizer state holds an `EmaState` anywhere (a partition's group too)."""
    if isinstance(tree, EmaState):
        return True
    if depth > 32:
        return False
    if isinstance(tree, dict):
        return any(_holds_ema(v, depth + 1) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return any(_holds_ema(v, depth + 1) for v in tree)
    return False


def _merged(module: nn.Module, *, sharded: bool) -> nn.Module:
    from ftrain.extras.lora import is_quantized

    if not callable(getattr(module, "merge_and_unload", None)):
        raise ValueError("merge=True needs a PEFT model (adapters to merge)")
    if is_quantized(module):
        raise ValueError(
            "merge=True on a 4-/8-bit base would round the merged weights to the base's "
            "quantization: export the adapter, then merge it into a full-precision base with "
            "PeftModel.from_pretrained(base, adapter).merge_and_unload()"
        )
    if sharded:
        raise ValueError("merge=True is not supported for sharded (FSDP) states")
    _refuse_tied_merges(module)
    import copy

    with torch.no_grad():
        return copy.deepcopy(module).merge_and_unload()  # type: ignore[operator]


def _refuse_tied_merges(module: nn.Module) -> None:
    """Raise if an adapter would be merged into a weight that another layer shares.

    A tied embedding and output layer share one tensor; an adapter on one of them changes only
    that layer in training, but merged into the shared tensor it changes both (the exported
    logits differed from the trained model's by 33 on a tiny tied Llama).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for name, layer in module.named_modules():
        weight = getattr(layer.get_base_layer(), "weight", None) if isinstance(
            layer, BaseTunerLayer
        ) else None  # fmt: skip
        others = [n for n in names.get(id(weight), []) if not n.startswith(f"{name}.")]
        if weight is not None and others:
            raise ValueError(
                f"merge=True would merge the adapter of {name!r} into a weight tied to "
                f"{others[0]!r}, changing that layer too: the merged model would not compute "
                "what was trained. Export the adapter (merge=False) and load it with "
                "PeftModel.from_pretrained, or untie the weights before training "
                "(tie_word_embeddings=False)"
            )


def _save_module(
    module: nn.Module, tmp: Path, tokenizer: Any, full: dict[str, torch.Tensor] | None
) -> None:
    save = getattr(module, "save_pretrained", None)
    if full is None:  # (sharded: the gathered tensors share no storage with the module's)
        trained = [n for n, p in module.named_parameters() if p.requires_grad]
        _refuse_dropped_weights(module, trained)
    if callable(save):
        save(tmp) if full is None else save(tmp, state_dict=full)
    elif full is None:
        from safetensors.torch import save_model

        save_model(module, str(tmp / "model.safetensors"))
    else:
        from safetensors.torch import save_file

        save_file({n: t.clone().contiguous() for n, t in full.items()}, tmp / "model.safetensors")
    _lift_adapter(module, tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def export_checkpoint(
    path: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    config: str | os.PathLike[str] | None = None,
    base: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    weights: Literal["live", "ema"] | None = None,
    allow_other_base: bool = False,
    live_buffers: bool = False,
) -> Path:
    """Export a checkpoint of an HF model without the training script (the CLI's `export`).

    Builds the model from `config` (a directory or `config.json`; by default the one saved in
    the checkpoint), or loads it from `base` when some parameters were frozen and therefore not
    saved, copies in the checkpoint's tensors and saves it with `save_pretrained`. A LoRA
    (PEFT) checkpoint exports its adapter, which `PeftModel.from_pretrained(base, directory)`
    loads; it needs neither `base` nor the base's weights.

    A run trained with `ft.optim.ema` saved two sets of weights: the live ones (which training
    goes on from) and their average (which evaluation inside `swap_ema` uses). Which one to
    export is not guessed: `weights` says ("ema" or "live"); without it such a checkpoint is
    refused. A checkpoint without an average has only the live weights (`weights=None` or
    "live"). `ft.optim.ema` averages the parameters, not BatchNorm's running statistics: the
    average of a model with them is refused unless `live_buffers=True` (`--live-buffers`)
    takes the live statistics beside it, as `swap_ema(state, live_buffers=True)` does.

    The frozen parameters come from `base`, so it must be the base the run trained on: its
    frozen weights are compared with the checkpoint's record, as `load_checkpoint` does
    (docs/checkpoints.md, "The base model"); `allow_other_base=True` (`--allow-other-base`)
    skips that, to merge the trained weights onto another base on purpose.

    Raises:
        CheckpointError: if the checkpoint is invalid or lacks parameters the model needs.
        CheckpointMismatchError: if the frozen weights of `base` differ from those the
            checkpoint was trained on (without `allow_other_base`).
        ValueError: for both `config` and `base` (the model comes from `base` then: `config`
            would be ignored), and `allow_other_base` without `base` (nothing to allow); for
            an EMA checkpoint without `weights`, and `weights="ema"` for one without an EMA
            average of every trainable parameter, or with running statistics and not
            `live_buffers=True`; for `live_buffers=True` without `weights="ema"`.
    """
    if config is not None and base is not None:
        raise ValueError(
            "export_checkpoint takes config or base, not both: with base the model is loaded "
            "from it (its own config), so config would be ignored"
        )
    _check_weights("export_checkpoint", weights, live_buffers)
    if not isinstance(allow_other_base, bool):
        raise TypeError(f"allow_other_base must be True or False, got {allow_other_base!r}")
    if allow_other_base and base is None:
        raise ValueError(
            "export_checkpoint got allow_other_base=True without base: it allows exporting onto "
            "another base model, and without base there is none (the model is built from the "
            "checkpoint's config), so it would be ignored; pass base=<pretrained dir>, or drop "
            "allow_other_base"
        )
    path = Path(path)
    _refuse_replacing_checkpoints(Path(directory), overwrite)
    # The one validator: marker, state.json, files, sizes, checksums and config.json.
    opened = open_checkpoint(path, keep=("model", "optimizer") if weights == "ema" else ("model",))
    if weights is None and opened.ema_averages:
        raise ValueError(
            f"{path} was trained with ft.optim.ema: it holds the live weights and their EMA "
            "average, and which one to export is not guessed. Pass weights='ema' (--weights "
            "ema: the average, what evaluation inside swap_ema uses) or weights='live' "
            "(--weights live: the weights training goes on from)"
        )
    meta = opened.meta
    adapters = _adapters(path, meta)
    shapes = opened.tensors["model"]  # meta-device placeholders when sharded
    if base is None:  # compare on the meta device first: a forged config allocates nothing
        with torch.device("meta"):
            skeleton, guessed = _build(path, config, None, opened.config, meta)
            skeleton = _with_adapter(skeleton, adapters, path)
        _check_fits(path, skeleton, shapes, meta, bool(adapters), guessed=guessed)
    model, guessed = _build(path, config, base, opened.config, meta)
    model = _with_adapter(model, adapters, path)
    _set_generation_config(model, _generation_config(path, meta))
    # A sharded checkpoint's, assembled from its shards; the averages in place with "ema".
    saved = read_model_tensors(opened, weights=weights or "live", live_buffers=live_buffers)
    _check_fits(path, model, saved, meta, bool(adapters), base=base, guessed=guessed)
    _cast_to_recorded(model, meta, saved)  # the dtypes the record's sums were taken in
    if base is not None and not allow_other_base:
        _refuse_other_base(opened, model)
    live = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    _refuse_dropped_weights(model, [n for n, _ in model.named_parameters() if n in saved])
    with torch.no_grad():
        for n, t in saved.items():
            live[n].copy_(t)
    return write_atomically(
        directory, lambda tmp: _save_pretrained(model, tmp), overwrite=overwrite
    )


def _refuse_other_base(opened: Opened, model: nn.Module) -> None:
    """Raise if the frozen weights of the base loaded for `opened` differ from its record."""
    differences = base_differences(opened, model)
    if differences:
        raise CheckpointMismatchError(
            opened.path,
            differences,
            hint="pass allow_other_base=True (export --allow-other-base) to export onto this "
            "base on purpose",
        )


def _cast_to_recorded(
    model: nn.Module, meta: dict[str, Any], saved: dict[str, torch.Tensor]
) -> None:
    """Give each parameter the dtype the checkpoint recorded for it (mixed ones included) and
    each saved buffer its saved dtype, as `export_pretrained` of the trained model writes them.

    The model was built as its config says, which need not be how it trained: a bf16 run was
    exported as float32, and a config saying bf16 rounded float32 weights into bf16.
    """
    recorded = {r[0]: getattr(torch, r[1], None) for r in meta["params"]}  # validated names
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for n, p in model.named_parameters():
            dtype = recorded.get(n)
            if isinstance(dtype, torch.dtype) and p.dtype != dtype:
                p.data = p.data.to(dtype)  # the same Parameter: tied weights stay tied
        for n, t in saved.items():
            if n in buffers and buffers[n].dtype != t.dtype:
                owner, _, leaf = n.rpartition(".")
                setattr(model.get_submodule(owner), leaf, buffers[n].to(t.dtype))


def _refuse_dropped_weights(module: nn.Module, trained: list[str]) -> None:
    """Raise if a PEFT model's `save_pretrained` would leave out one of its `trained` parameters.

    PEFT writes the adapters (and `modules_to_save`) only: a base parameter unfrozen by hand
    (`lm_head.weight.requires_grad_(True)`) is trained, saved in checkpoints, and silently
    missing from the adapter, which then computes another function than the trained model.
    What PEFT writes is taken from PEFT itself (its tensors share the parameters' storage).
    """
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return
    from peft import get_peft_model_state_dict

    written = {
        t.data_ptr()
        for name in configs
        for t in get_peft_model_state_dict(module, adapter_name=name).values()
    }
    params = dict(module.named_parameters())
    dropped = [
        n
        for n in trained
        if n in params and "prompt_encoder" not in n  # prompt learning saves a computed tensor
        and params[n].numel() and params[n].data_ptr() not in written
    ]  # fmt: skip
    if dropped:
        raise ValueError(
            f"the PEFT adapter would not hold {len(dropped)} trained parameter(s) of the base "
            f"model, e.g. {dropped[:3]} (unfrozen by hand: PEFT saves adapters and "
            "modules_to_save only), so the exported adapter would not compute what was "
            "trained: train them through LoraConfig(modules_to_save=[...]), or export a full "
            "model (ft.export_pretrained(..., merge=True))"
        )


def _save_pretrained(model: Any, tmp: Path) -> None:
    model.save_pretrained(tmp)
    _lift_adapter(model, tmp)


def _lift_adapter(module: Any, tmp: Path) -> None:
    """Move a lone adapter named other than "default" from `tmp/<name>/`, where PEFT writes
    it, to `tmp`, where `PeftModel.from_pretrained(base, tmp)` looks for it."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or len(configs) != 1:
        return
    (name,) = configs
    sub = tmp / str(name)
    if name == "default" or not sub.is_dir() or (tmp / _ADAPTER_CONFIG).exists():
        return
    for f in sub.iterdir():
        f.replace(tmp / f.name)
    sub.rmdir()


_ADAPTER_CONFIG = "adapter_config.json"  # what PeftModel.from_pretrained(base, dir) reads
# state.json keys (docs/checkpoints.md, "What is in a checkpoint"); each absent in older ones.
_ADAPTERS, _GENERATION, _MODEL_CLASS = "peft_adapters", "generation_config", "model_class"
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a module name; never a path


def _adapters(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's PEFT adapter configs by name: {} without one; one, or refused."""
    named = meta.get(_ADAPTERS)
    if named is None:  # older checkpoints recorded a lone "default" adapter only
        return {} if meta.get("peft") is None else {"default": meta["peft"]}
    if not isinstance(named, dict) or not all(
        isinstance(k, str) and _ADAPTER_NAME.fullmatch(k) for k in named
    ):
        raise CheckpointError(f"{path}: the saved adapter configs ({_ADAPTERS!r}) are malformed")
    if len(named) != 1:
        raise CheckpointError(
            f"{path} holds {len(named)} PEFT adapters ({', '.join(sorted(named))}); export "
            "writes one: export from the training script with ft.export_pretrained (PEFT's "
            "layout: 'default' at the top, the others in sub-folders named after them), or "
            "train with one adapter (model.delete_adapter the others before saving)"
        )
    return dict(named)


def _generation_config(path: Path, meta: dict[str, Any]) -> Any:
    """The saved GenerationConfig (checked: any JSON may be in a forged file), or None."""
    raw = meta.get(_GENERATION)
    if raw is None:  # older checkpoints, and models that do not generate
        return None
    from transformers import GenerationConfig

    try:
        if not isinstance(raw, dict):
            raise TypeError(f"not a JSON object but a {type(raw).__name__}")
        odd = [k for k in raw if k.startswith("__") or callable(getattr(GenerationConfig, k, None))]
        if odd:  # from_dict sets every key as an attribute: none may replace a method
            raise ValueError(f"{odd[:3]} are not generation settings")
        generation = GenerationConfig.from_dict(raw)
        generation.validate()
        return generation
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError, OverflowError) as e:
        raise CheckpointError(
            f"{path}: the saved generation config ({_GENERATION!r} in state.json) is malformed: {e}"
        ) from e


def _set_generation_config(model: Any, generation: Any) -> None:
    if generation is not None:
        unwrap = getattr(model, "get_base_model", None)  # a PeftModel: the HF model inside
        (unwrap() if callable(unwrap) else model).generation_config = generation


def _check_fits(
    path: Path,
    model: Any,
    saved: dict[str, torch.Tensor],
    meta: dict[str, Any],
    adapter: bool,
    base: Any = None,
    guessed: bool = False,
) -> None:
    """The checkpoint's tensors fit `model` (names and shapes; compared on any device)."""
    params = dict(model.named_parameters())
    # An adapter export needs the adapter's tensors only; a full model needs every parameter.
    needed = [n for n, p in params.items() if p.requires_grad or not adapter]
    missing = sorted(n for n in needed if n not in saved) if base is None else []
    live = {**dict(model.named_buffers()), **params}
    unknown = sorted(n for n in saved if n not in live)
    if guessed and (missing or unknown):  # the wrong class, not frozen parameters
        raise CheckpointError(
            f"cannot tell which model class {path} was trained with: its config names no "
            "`architectures` and the checkpoint records no class (saved by an older ftrain), "
            f"and {type(model).__name__}, the causal LM of its model_type, does not fit it "
            f"(e.g. {(unknown or missing)[:3]}); pass config=<dir or config.json> (--config) "
            'whose `architectures` names the class (e.g. ["BertForSequenceClassification"]), '
            "or export from the training script with ft.export_pretrained"
        )
    if missing:
        raise CheckpointError(
            f"{path} lacks {len(missing)} parameter(s) (frozen during training), e.g. "
            f"{missing[:3]}; pass base=<pretrained dir> (--base) to take them from there"
        )
    if unknown:
        raise CheckpointError(f"{path} holds tensors the model does not have: {unknown[:5]}")
    for n, t in saved.items():
        if live[n].shape != t.shape:
            raise CheckpointError(f"{n}: checkpoint {list(t.shape)}, model {list(live[n].shape)}")
    recorded = {r[0]: r[2] for r in meta["params"]}
    for n, p in params.items():  # frozen ones too: the table records every parameter
        if n in recorded and list(p.shape) != recorded[n]:
            raise CheckpointError(
                f"{n}: the model config gives {list(p.shape)}, the checkpoint recorded "
                f"{recorded[n]}"
            )


def _with_adapter(model: Any, adapters: dict[str, Any], path: Path) -> Any:
    """`model` with the checkpoint's adapter (`_adapters`: none or one) under its own name."""
    if not adapters:
        return model
    from peft import PeftConfig, get_peft_model

    ((name, adapter),) = adapters.items()
    try:
        if not isinstance(adapter, dict):
            raise TypeError(f"not a dict: {type(adapter).__name__}")
        base_name = adapter.get("base_model_name_or_path")
        if isinstance(base_name, str):  # keep the adapter pointing at its real base
            model.name_or_path = model.config._name_or_path = base_name
        return get_peft_model(model, PeftConfig.from_peft_type(**adapter), adapter_name=name)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path}: the saved adapter config is malformed: {e}") from e


def _build(
    path: Path,
    config: str | os.PathLike[str] | None,
    base: Any,
    saved: dict[str, Any] | None,
    meta: dict[str, Any],
) -> tuple[Any, bool]:
    """The model to copy the checkpoint into, and whether its class was guessed (a causal LM:
    neither the checkpoint nor the config names one)."""
    import transformers

    recorded = meta.get(_MODEL_CLASS)
    if base is not None:
        from huggingface_hub.errors import StrictDataclassClassValidationError

        cls, guessed = _model_class(recorded, None)
        try:
            return cls.from_pretrained(base), guessed
        except StrictDataclassClassValidationError as e:  # a config the class refuses
            why = " ".join(str(e).split())  # one line: the CLI prints one
            raise ValueError(f"cannot load {cls.__name__} from {base}: {why}") from e
    if config is not None:
        source = Path(config)
        source = source / "config.json" if source.is_dir() else source
        raw = _read_config(source)
    elif saved is not None:
        raw = saved  # checked against its recorded size and digest
    else:
        raise CheckpointError(
            f"no config.json in {path}: pass config=<dir or config.json> (--config) for the "
            "model's architecture"
        )
    try:
        if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
            raise ValueError("not a JSON object with a 'model_type'")
        settings = dict(raw)
        kind = settings.pop("model_type")
        if kind not in transformers.CONFIG_MAPPING:  # transformers' own error lists every type
            raise CheckpointError(
                f"cannot build a model from the config of {path}: its model_type {kind!r} is "
                "not registered with transformers' Auto classes (a model of your own, such as "
                "the examples' char_gpt): export it from your script with "
                "ft.export_pretrained, or register it (AutoConfig.register, "
                "AutoModelForCausalLM.register) before exporting"
            )
        cfg = transformers.AutoConfig.for_model(kind, **settings)
        arch = (getattr(cfg, "architectures", None) or [None])[0]
        cls, guessed = _model_class(recorded, arch)
        return (cls.from_config(cfg) if guessed else cls(cfg)), guessed
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"cannot build a model from the config of {path}: {e}") from e


def _model_class(*names: Any) -> tuple[Any, bool]:
    """The first of `names` that is a transformers model class (the one the checkpoint
    recorded, then the config's `architectures`), else AutoModelForCausalLM, guessed."""
    import transformers

    for name in names:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls, False
    return transformers.AutoModelForCausalLM, True


def _read_config(source: Path) -> Any:
    """The JSON of a config file the caller names (`config=`, `--config`)."""
    try:
        return json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"cannot read the model config {source}: {e}") from e
