"""LoRA and QLoRA through PEFT, set up the way qlora.py does it.

    model = ft.lora.load_4bit("path/to/base")           # QLoRA: NF4 base weights (bitsandbytes)
    model = ft.lora.apply(model, r=64, alpha=16)        # adapters on every linear but the head
    state = ft.TrainState.create(model, ft.optim.from_torch(bnb.optim.PagedAdamW32bit), ...)

Only the adapters require gradients, so only they are in `state.params`, in the optimizer state
and in checkpoints; `export_pretrained(state, dir)` writes the adapter that
`PeftModel.from_pretrained` loads, and `merge=True` writes a full model instead.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["apply", "enable_checkpointing", "find_all_linear_names", "is_quantized", "load_4bit"]


def find_all_linear_names(model: nn.Module) -> list[str]:
    """The names (last component) of every linear layer but the LM head: LoRA's targets.

    qlora.py's `find_all_linear_names`: `torch.nn.Linear` and its bitsandbytes 4-/8-bit
    subclasses, by the last part of their module name (`q_proj`, `up_proj`, ...), leaving out
    the output embedding (`lm_head`).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                   num_hidden_layers=1, num_attention_heads=2)
        >>> find_all_linear_names(LlamaForCausalLM(cfg))
        ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
    """
    head = getattr(model, "get_output_embeddings", lambda: None)()
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            names.add(name.split(".")[-1])
    names.discard("lm_head")
    return sorted(names)


def apply(
    model: nn.Module,
    *,
    r: int = 64,
    alpha: int = 16,
    dropout: float = 0.0,
    targets: list[str] | str | None = None,
    bias: Literal["none", "all", "lora_only"] = "none",
    task_type: str | None = None,
    train_head: bool = True,
    **lora_kwargs: Any,
) -> nn.Module:
    """Wrap `model` with LoRA adapters (`peft.get_peft_model`); only the adapters train.

    Defaults are qlora.py's (`lora_r=64`, `lora_alpha=16`, `lora_dropout=0.0`, every linear
    layer but the head).

    PEFT's task type follows the model's head, as `ft.losses.loss_for` reads it: `CAUSAL_LM`
    for causal LMs, `SEQ_2_SEQ_LM` for encoder-decoders (T5, BART), `SEQ_CLS` for
    `*ForSequenceClassification`, `TOKEN_CLS` for `*ForTokenClassification`, `QUESTION_ANS` for
    `*ForQuestionAnswering`, and none (a plain `PeftModel`) for other models, including
    `*ForMultipleChoice` (PEFT has no task type for it). A classifier's head (those four and
    `*ForMultipleChoice`) is new (randomly initialised): its modules, every top-level module
    with parameters beside the backbone (`classifier`, `score`, BART's `classification_head`,
    ...), go into `modules_to_save` (each name once), so they train in full (no adapter on
    them) and the adapter saves them; left frozen they would stay random, and a reloaded
    adapter would get another random head. A head that is already trained (a fine-tuned
    classifier, a reward model) stays frozen with `train_head=False`, without adapters. The
    adapter then needs the base model with that trained head: load it with
    `PeftModel.from_pretrained(trained_classifier, adapter)` (and export a checkpoint with
    `--base`). PEFT's classifier wrappers still wrap a head named `classifier` or `score` (they
    always do), so that adapter also carries the head's unchanged copy; reloaded with
    `is_trainable=True`, PEFT makes that copy trainable again (freeze it by hand).

    Args:
        model: an HF model (full precision, or from `load_4bit`).
        r: LoRA rank.
        alpha: LoRA scaling numerator (the update is scaled by alpha / r).
        dropout: dropout on the adapters' input.
        targets: module names to adapt; `find_all_linear_names(model)` by default.
        bias: passed to `peft.LoraConfig`.
        task_type: PEFT's task type (a `peft.TaskType` or its name, in capitals as PEFT reads
            it: `"SEQ_CLS"`); None (default) infers it from the model as above. One that
            contradicts the model's head raises.
        train_head: False keeps a classifier's head frozen (trained already): only the
            adapters train, and none is put on the head (its modules join PEFT's
            `exclude_modules`). True (default) trains the head in full, as above.
        **lora_kwargs: passed to `peft.LoraConfig`; a classifier's `modules_to_save` get its
            head's modules added (unless `train_head=False`); a name whose every match lies
            inside a module already saved whole (`"classifier.dense"` beside the head
            `"classifier"`) is dropped: PEFT could not reload the nested copies.

    Raises:
        ValueError: for `r` not an int >= 1, `alpha` not a finite number > 0 (`alpha=0` scales
            every adapter by 0: nothing would ever train), or `dropout` outside [0, 1); for a
            name in a `targets` list that matches no module (PEFT adapts the others and drops
            it silently), no linear layer to adapt by default (e.g. GPT-2's `Conv1D` layers:
            pass `targets`), a `modules_to_save` name that matches no module (PEFT skips it
            silently), a model that already holds PEFT adapters, a `task_type` other than the
            model's head or not one of PEFT's (`"seq_cls"`: PEFT refuses it too), or a
            classifier whose head cannot be found (pass `modules_to_save`); for a
            `modules_to_save` name matching modules both inside and outside another saved
            module (PEFT would nest one wrapper in another and fail to reload it); for
            `train_head=False` on a model without a classifier head, or with a
            `modules_to_save` name inside that head; for an adapter (or `modules_to_save`
            copy) on a module whose weight the forward uses only through other modules
            (T5's and BART's `shared` embedding, tied to the `embed_tokens` and `lm_head` the
            forward calls: it would get no gradient), naming the modules to adapt instead. A
            target whose weight another module shares, or that is reachable under several
            names, where it cannot be told which the forward calls (a model without HF's
            embedding accessors), gets a `UserWarning` naming the other names.
        TypeError: for `modules_to_save` that is not a list of names (a string: PEFT reads
            it letter by letter), a `task_type` that is neither a `peft.TaskType`, a string
            nor None, or
            a `LoraConfig` keyword this function takes under its own name (`target_modules`:
            pass `targets`; `lora_alpha`: `alpha`; `lora_dropout`: `dropout`).
        ImportError: without peft (`pip install 'ftrain[hf]'`).
    """
    _check_hyperparameters(r, alpha, dropout)
    # PEFT's own names of this function's arguments: passed twice, PEFT's TypeError named
    # neither the argument to use nor this function.
    renamed = {"lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "targets"}
    if given := sorted(k for k in lora_kwargs if k in renamed):
        raise TypeError(
            f"ft.lora.apply takes {', '.join(f'{renamed[k]}=' for k in given)} as its own "
            f"argument(s), not {', '.join(f'{k}=' for k in given)} among the LoraConfig keywords"
        )
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is part of the hf extra
        raise ImportError("LoRA needs peft: pip install 'ftrain[hf]'") from e
    _check_model(model)
    defaulted = targets is None
    targets = _targets(model, targets)
    _check_modules_to_save(model, lora_kwargs.get("modules_to_save"))
    task_type = _task_type(model, task_type)
    # A new head is told by the class, not the task type: PEFT has no task type for multiple
    # choice, whose new classifier stayed frozen and random, and out of the adapter.
    classifier = task_type in _CLASSIFIERS or _has_new_head(model)
    frozen = _frozen_heads(model, train_head, classifier, lora_kwargs.get("modules_to_save"))
    if classifier and train_head:
        lora_kwargs["modules_to_save"] = _with_heads(model, lora_kwargs.get("modules_to_save"))
    if frozen:  # no adapter on a frozen head either (BART's dense, out_proj are LoRA targets)
        lora_kwargs["exclude_modules"] = _excluding(
            model, frozen, lora_kwargs.get("exclude_modules")
        )
    if isinstance(lora_kwargs.get("modules_to_save"), (list, tuple, set)):
        guesses = _PEFT_HEADS.get(task_type or "", ()) if classifier else ()
        lora_kwargs["modules_to_save"] = _unnested(
            model, list(lora_kwargs["modules_to_save"]), guesses
        )
    _check_tied(
        model, targets, lora_kwargs.get("exclude_modules"), lora_kwargs.get("modules_to_save")
    )
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias=bias,
        task_type=task_type,
        **lora_kwargs,
    )
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as e:
        import peft

        nothing = getattr(peft, "NoMatchingPeftModuleError", None)  # peft >= 0.15
        if not (defaulted and nothing is not None and isinstance(e, nothing)):
            raise
        # Every linear layer found is in the head (GPT-2's classifiers: `score` is its only
        # torch.nn.Linear, the rest are Conv1D) or excluded.
        raise ValueError(
            f"ft.lora.apply found no layer to adapt in {type(model).__name__}: its "
            f"torch.nn.Linear layers ({targets}) are all in its head or excluded "
            "(exclude_modules). Pass targets=[...]; GPT-2 style models use Conv1D: "
            "targets=['c_attn', 'c_proj', 'c_fc'] with fan_in_fan_out=True (its weight layout)"
        ) from e
    # PEFT's classifier wrappers append their guesses ("classifier", "score") to the names
    # given: ['classifier', 'classifier', 'score'] in the saved adapter_config.json.
    if isinstance(config.modules_to_save, list):
        config.modules_to_save[:] = dict.fromkeys(config.modules_to_save)
    _freeze(wrapped, frozen)
    return wrapped


# `ft.losses.loss_for`'s losses (by factory name) and the PEFT task type of their heads.
_TASKS = MappingProxyType(
    {
        "causal_lm_loss": "CAUSAL_LM",
        "seq2seq_loss": "SEQ_2_SEQ_LM",
        "classification_loss": "SEQ_CLS",
        "token_classification_loss": "TOKEN_CLS",  # *ForTokenClassification (not masked LMs)
    }
)
_CLASSIFIERS = ("SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS")
# HF's task heads that are new (randomly initialised) on a pretrained backbone, by class name
# ending; multiple choice has no PEFT task type (a plain PeftModel) but its head is as new.
_NEW_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
)


# The names PEFT's classifier wrappers add to `modules_to_save` themselves, by task type.
_PEFT_HEADS = MappingProxyType(
    {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"),
     "QUESTION_ANS": ("qa_outputs",)}
)  # fmt: skip


def _frozen_heads(model: nn.Module, train_head: Any, classifier: bool, names: Any) -> list[str]:
    """The head modules to keep frozen: none with `train_head=True`, else the classifier's."""
    if not isinstance(train_head, bool):
        raise TypeError(f"ft.lora.apply train_head must be True or False, got {train_head!r}")
    if train_head:
        return []
    if not classifier:
        raise ValueError(
            f"ft.lora.apply train_head=False, but {type(model).__name__} has no classifier "
            "head to keep frozen (only adapters train on it anyway); drop train_head"
        )
    heads = _with_heads(model, None)
    keys = [key for key, _ in model.named_modules(remove_duplicate=False)]
    inside = [
        n
        for n in names or []
        if any(k.endswith(n) and any(k == h or k.startswith(f"{h}.") for h in heads) for k in keys)
    ]
    if inside:
        raise ValueError(
            f"ft.lora.apply train_head=False, but modules_to_save {inside} lie in the head "
            f"{heads}, which PEFT saves whole: keep the head frozen (drop them) or train it "
            "(drop train_head)"
        )
    return heads


def _unnested(model: nn.Module, names: list[str], guesses: tuple[str, ...]) -> list[str]:
    """`names` less those whose every module lies inside another saved module.

    PEFT wraps every module whose full name ends with a name, the outer one first, and then a
    copy inside a copy: `PeftModel.from_pretrained` failed with a KeyError on the nested
    module's weights. A name matching modules both inside and outside is refused."""
    keys = [key for key, _ in model.named_modules(remove_duplicate=False)]
    wrapped = {k for k in keys for n in [*names, *guesses] if n and k.endswith(n)}
    kept = []
    for name in names:
        mine = [k for k in keys if name and k.endswith(name)]
        nested = [k for k in mine if any(k.startswith(f"{w}.") for w in wrapped)]
        if nested and len(nested) < len(mine):
            raise ValueError(
                f"ft.lora.apply modules_to_save entry {name!r} matches {nested[:3]}, inside "
                "other modules PEFT saves whole, and modules outside them: PEFT would nest one "
                "saved copy in another and fail to reload the adapter; name the outer modules "
                "by their full names"
            )
        if not nested:
            kept.append(name)
    return kept


def _excluding(model: nn.Module, heads: list[str], given: Any) -> list[str] | str:
    """PEFT's `exclude_modules`: `given` plus every module of the `heads` (by full name)."""
    keys = [
        k for k, _ in model.named_modules() if any(k == h or k.startswith(f"{h}.") for h in heads)
    ]
    if isinstance(given, str):  # a regular expression PEFT fullmatches against full names
        return "|".join([f"(?:{given})", *(re.escape(k) for k in keys)])
    return list(dict.fromkeys([*(given or []), *keys]))


def _freeze(wrapped: nn.Module, heads: list[str]) -> None:
    """Freeze every parameter of the `heads`: the copies PEFT's wrappers make trainable, and
    the biases `bias="all"` unfreezes."""
    for key, module in wrapped.named_modules():
        if any(key == h or key.endswith(f".{h}") for h in heads):
            module.requires_grad_(False)


def _has_new_head(model: nn.Module) -> bool:
    return any(c.__name__.endswith(_NEW_HEADS) for c in type(model).__mro__)


def _inferred_task(model: nn.Module) -> str | None:
    """PEFT's task type for `model`'s head, as `loss_for` reads the head; None if unknown."""
    from ftrain.losses import loss_for, loss_name

    names = [c.__name__ for c in type(model).__mro__]
    if any(n.endswith("ForQuestionAnswering") for n in names):
        return "QUESTION_ANS"
    try:
        factory = loss_name(loss_for(model)).split(".<locals>")[0].rsplit(".", 1)[-1]
    except TypeError:  # a model loss_for does not know: PEFT's plain PeftModel
        return None
    task = _TASKS.get(factory)
    if task == "TOKEN_CLS" and not any(n.endswith("ForTokenClassification") for n in names):
        return None  # masked LMs (BERT's `cls` head is pretrained): no classifier to save
    return task


def _task_type(model: nn.Module, given: Any) -> str | None:
    """The task type to use: the model's, or `given` when it agrees (or the model's is
    unknown). PEFT's default, CAUSAL_LM, wrapped T5 and classifiers in PeftModelForCausalLM:
    a classifier's new head stayed frozen and random, and was not saved with the adapter."""
    inferred = _inferred_task(model)
    if given is None:
        return inferred
    from peft import TaskType

    name = getattr(given, "value", given)
    if not isinstance(name, str):
        raise TypeError(f"task_type must be a peft.TaskType, its name or None, got {given!r}")
    names = [t.value for t in TaskType]
    if name not in names:  # PEFT reads names as written: 'seq_cls' is no task type to it
        close = [n for n in names if n == name.upper()]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"ft.lora.apply task_type={given!r} is not one of PEFT's task types {names}{hint}"
        )
    if inferred is not None and name != inferred:
        raise ValueError(
            f"ft.lora.apply task_type={name!r}, but {type(model).__name__} is a "
            f"{inferred} model (PEFT's {name} wrapper would read its batches, generate or save "
            f"its head as another task's); drop task_type (it is inferred: {inferred!r})"
        )
    return name


def _with_heads(model: nn.Module, names: Any) -> list[str]:
    """`names` plus the modules of a classifier's new head: the top-level modules with
    parameters beside the backbone (`model.base_model_prefix`), else PEFT's own guesses."""
    prefix = getattr(model, "base_model_prefix", None)
    backbone = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    heads = [
        name
        for name, child in model.named_children()
        if backbone is not None and child is not backbone and any(True for _ in child.parameters())
    ]
    if backbone is None:
        keys = [key for key, _ in model.named_modules()]
        heads = [h for h in ("classifier", "score") if any(k.endswith(h) for k in keys)]
    if not heads and not names:
        raise ValueError(
            f"ft.lora.apply found no head in {type(model).__name__} (no module beside its "
            "backbone, none named 'classifier' or 'score'): its classifier would stay frozen "
            "(random, if new) and the adapter would not save it; pass modules_to_save=[...] "
            "naming it"
        )
    return list(dict.fromkeys([*(names or []), *heads]))


def _check_model(model: nn.Module) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    # get_peft_model on a PEFT model nests a second one inside it, adapting the first one's
    # own layers (`base_layer`, `default`): two adapter stacks nobody asked for.
    if hasattr(model, "peft_config") or any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ValueError(
            "ft.lora.apply got a model that already holds PEFT adapters; apply LoRA to the "
            "base model once (add another adapter with model.add_adapter(name, config))"
        )


def _targets(model: nn.Module, targets: list[str] | str | None) -> list[str] | str:
    """The target modules, checked: PEFT raises only when no target matches, so a misspelt
    name beside good ones would be dropped without a word."""
    if targets is None:
        found = find_all_linear_names(model)
        if not found:
            raise ValueError(
                f"ft.lora.apply found no torch.nn.Linear layer to adapt in "
                f"{type(model).__name__} (GPT-2 style models use Conv1D): pass targets=[...], "
                "e.g. targets=['c_attn', 'c_proj', 'c_fc']"
            )
        return found
    if isinstance(targets, str):
        return targets  # a regular expression over full module names, as PEFT reads it
    names = [name for name, _ in model.named_modules()]
    # PEFT's rule for a list: the full name, or its ending after a dot.
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise ValueError(
            f"ft.lora.apply targets {missing} match no module of {type(model).__name__} (PEFT "
            f"would adapt the other targets and drop these silently); choose among "
            f"find_all_linear_names(model) = {find_all_linear_names(model)}"
        )
    return list(targets)


def _check_tied(model: nn.Module, targets: Any, exclude: Any, to_save: Any) -> None:
    """Refuse adapters (and `modules_to_save` copies) on a module whose weight the forward
    uses only through other modules; warn for other modules that share their weight or are
    reachable under several names.

    PEFT replaces a module under one name. A weight tied to other modules, or a module object
    reachable under other names, is then still used without the adapter wherever the forward
    reaches it through them: T5's and BART's `shared` embedding (transformers 5 ties its
    weight to `encoder.embed_tokens`, `decoder.embed_tokens` and `lm_head`, which the forward
    calls; transformers 4 reached the same module as `encoder.embed_tokens`) is never called
    itself, so its adapter got no gradient at all, and only `accumulate_grads`' warning after
    32 steps (or an autograd error, with no other adapter) said so. For an HF model the modules
    the forward calls for its embeddings are known (`get_output_embeddings()`, and the input
    embeddings of its encoder and decoder, or of its base model); an adapter on one of those
    trains (merging it into the tied weight is refused by `export_pretrained(merge=True)`),
    and a tied module that is none of them while another module holding its weight is, is
    refused.
    """
    paths: dict[int, list[str]] = {}  # a module -> every name it is reachable under
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(name)
    owners: dict[int, list[str]] = {}  # a parameter -> the modules holding it
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    called = _called_embeddings(model, paths)

    def adapted(name: str) -> bool:  # PEFT's rules for target_modules and exclude_modules
        def hit(spec: Any) -> bool:
            if isinstance(spec, str):
                return re.fullmatch(spec, name) is not None
            return any(name == t or name.endswith(f".{t}") for t in spec or ())

        return hit(targets) and not (exclude and hit(exclude))

    def saved(name: str) -> bool:  # PEFT's rule for modules_to_save: the name's ending
        return any(n and name.endswith(n) for n in to_save or ())

    dead, shared = [], []
    for name, module in model.named_modules():  # the names PEFT matches (first name only)
        if not name:
            continue
        what = "LoRA adapter" if adapted(name) else "trained copy (modules_to_save)" if saved(
            name
        ) else None  # fmt: skip
        if what is None:
            continue
        partners = [n for n in paths[id(module)] if n != name]
        for param in module.parameters(recurse=False):
            partners += [n for n in owners[id(param)] if n not in paths[id(module)]]
        partners = list(dict.fromkeys(partners))
        if not partners:
            continue
        used = [n for n in partners if called is not None and n in called]
        if used and name not in (called or ()):
            dead.append((name, what, partners, used))
        elif called is None or name not in called:
            shared.append((name, what, partners))
    if dead:
        name, what, partners, used = dead[0]
        raise ValueError(
            f"ft.lora.apply would put a {what} on {name!r} "
            f"({type(model.get_submodule(name)).__name__}), whose weight {type(model).__name__}'s "
            f"forward uses through {_names(partners)} (tied to it) and never "
            f"through {name!r} itself: PEFT adapts the module under that one name, so the {what} "
            f"would get no gradient and never train. Leave {name!r} out (of targets and "
            f"modules_to_save); to adapt that weight, adapt the modules the forward calls: "
            f"{_names(used)}"
            + (f" (and {len(dead) - 1} more such module(s))" if len(dead) > 1 else "")
        )
    for name, what, partners in shared:
        warnings.warn(
            f"ft.lora.apply puts a {what} on {name!r}, whose weight (or the module itself) is "
            f"also reachable as {_names(partners)}: PEFT adapts it under "
            f"{name!r} alone, so wherever the forward reaches it under another name it runs "
            "without the adapter (and an adapter on a module the forward never calls gets no "
            "gradient). Adapt the modules the forward calls, or untie the weights first",
            UserWarning,
            stacklevel=3,
        )


def _names(names: list[str], shown: int = 4) -> str:
    """`names` quoted, the first `shown` of them and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(map(repr, names[:shown])) + more


def _called_embeddings(model: nn.Module, paths: dict[int, list[str]]) -> set[str] | None:
    """The names under which an HF model's forward calls its embedding modules: the output
    embeddings, and the input embeddings of its encoder and decoder (encoder-decoders) or of
    its base model; None for a model without HF's accessors (or when one fails)."""
    try:
        called: set[str] = set()
        out = model.get_output_embeddings()  # type: ignore[operator]
        if out is not None:
            called.update(paths.get(id(out), []))
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
            stacks = [model.get_encoder(), model.get_decoder()]  # type: ignore[operator]
        else:
            stacks = [getattr(model, "base_model", model)]
        for stack in stacks:
            embeddings = stack.get_input_embeddings()
            where = paths.get(id(stack), [])
            found = paths.get(id(embeddings), [])
            # The name through the stack: the stack calls its own attribute.
            inside = [n for n in found if any(n.startswith(f"{w}.") for w in where if w)]
            called.update(inside if stack is not model else found)
        return called
    except Exception:  # no HF accessors, or one that is not implemented
        return None


def _check_modules_to_save(model: nn.Module, names: Any) -> None:
    # PEFT wraps the modules whose full name ends with one of these, and skips a name that
    # matches none without a word: the layer the caller meant to train stays frozen.
    if names is None:
        return
    if not isinstance(names, (list, tuple, set)) or not all(isinstance(n, str) for n in names):
        # A string is read letter by letter: modules_to_save="lm_head" trained in full every
        # module whose name ends in "l", "m", "e", ... (the whole decoder `model`, its norm).
        raise TypeError(
            f"ft.lora.apply modules_to_save must be a list of module names, got {names!r}; "
            f"e.g. modules_to_save=[{names!r}]"
            if isinstance(names, str)
            else f"ft.lora.apply modules_to_save must be a list of module names, got {names!r}"
        )
    keys = [key for key, _ in model.named_modules(remove_duplicate=False)]
    missing = [n for n in names if not any(key.endswith(n) for key in keys)]
    if missing:
        raise ValueError(
            f"ft.lora.apply modules_to_save {missing} match no module of "
            f"{type(model).__name__} (PEFT would leave them out silently, and nothing of them "
            "would train); name modules by the end of their name, e.g. 'lm_head'"
        )


def _check_hyperparameters(r: Any, alpha: Any, dropout: Any) -> None:
    # peft accepts alpha=0 (adapters scaled by 0: no gradient ever reaches them) and turns a
    # negative or NaN dropout into no dropout; a bool is no number here (True is not 1).
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
        raise ValueError(f"r (the LoRA rank) must be an int >= 1, got {r!r}")
    if not (number(alpha) and alpha > 0):
        raise ValueError(
            f"alpha must be a finite number > 0 (the adapters are scaled by alpha / r), got "
            f"{alpha!r}"
        )
    if not (number(dropout) and 0 <= dropout < 1):
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")


def is_quantized(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a bitsandbytes quantized tensor."""
    return any(type(p).__name__ in ("Params4bit", "Int8Params") for p in model.parameters())


def load_4bit(
    path: str | os.PathLike[str],
    *,
    compute_dtype: torch.dtype = torch.bfloat16,
    quant_type: str = "nf4",
    double_quant: bool = True,
    gradient_checkpointing: bool = True,
    device: str | torch.device | None = None,
    **from_pretrained_kwargs: Any,
) -> nn.Module:
    """Load a causal LM with 4-bit base weights and prepare it for training adapters (QLoRA).

    qlora.py's setup: `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=...)`, then
    `peft.prepare_model_for_kbit_training` (frozen base, norms in float32, gradient
    checkpointing) and `use_cache=False`.

    Args:
        path: a directory (or hub id, when online) that `from_pretrained` reads.
        compute_dtype: dtype of the dequantized matmuls (qlora.py: bf16, or fp16 with --fp16).
        quant_type: "nf4" or "fp4".
        double_quant: quantize the quantization constants too.
        gradient_checkpointing: recompute activations in backward (qlora.py's default).
        device: where to load; `cuda:LOCAL_RANK` when CUDA is available, else the CPU.
        **from_pretrained_kwargs: passed to `AutoModelForCausalLM.from_pretrained`.

    Raises:
        ImportError: without bitsandbytes (`pip install 'ftrain[qlora]'`).
        RuntimeError: when bitsandbytes cannot quantize on this machine.
    """
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "QLoRA's 4-bit base weights need bitsandbytes: pip install 'ftrain[qlora]' "
            "(CPU support needs bitsandbytes >= 0.49)"
        ) from e
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_quant_type=quant_type,
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            quantization_config=quantization,
            device_map={"": str(device)},
            dtype=compute_dtype,
            **from_pretrained_kwargs,
        )
    except (RuntimeError, ValueError, NotImplementedError) as e:
        raise RuntimeError(
            f"bitsandbytes could not load {path} in 4 bits on {device}: {e}. 4-bit weights need "
            "a CUDA GPU, or bitsandbytes >= 0.49 on CPU"
        ) from e
    model.config.use_cache = False
    for module in model.modules():
        # On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight for inference the first
        # time its layer runs in eval mode, and the repacked matmul has no backward: training
        # after an evaluation would silently lose the gradient through the base weights
        # (bitsandbytes 0.50). Keep the trainable layout.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def enable_checkpointing(model: nn.Module) -> None:
    """Turn on HF activation (gradient) checkpointing, non-reentrant, under either name
    (`activation_checkpointing_enable` in transformers 5, `gradient_checkpointing_enable`
    before). Non-reentrant checkpointing needs no `enable_input_require_grads` for a frozen
    embedding."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
