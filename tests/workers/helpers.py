"""Shared builders: tiny HF models from configs, ragged token data, a fake data-parallel rank."""

from __future__ import annotations

import contextlib
import os
import random
import signal

import torch

import ftrain as ft


def rank_env(rank: int, world: int, port: int) -> None:
    """What a launcher sets for one rank of a local gloo group, and one intra-op thread (two
    ranks share the machine's cores)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )  # fmt: skip
    torch.set_num_threads(1)


def tiny_mixtral(router_logits: bool):
    """A 1-layer, 2-expert Mixtral (vocabulary 50) that returns its router loss when
    `router_logits` (`output_router_logits`, coefficient 0.5)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1, output_router_logits=router_logits, router_aux_loss_coef=0.5,
    )  # fmt: skip
    return MixtralForCausalLM(cfg)


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0, dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).to(dtype)


def ragged_rows(n: int, seed: int = 0, *, mask_prompt: bool = True, lo: int = 3, hi: int = 14):
    """Rows of random length; the first tokens are a prompt whose labels are -100."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(1, 61) for _ in range(rng.randrange(lo, hi))]
        prompt = rng.randrange(0, len(ids) - 1) if mask_prompt else 0
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


class FakeRank(ft.strategies.SingleDevice):
    """SingleDevice that claims to be rank `rank` of `world_size` (for data-split tests)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__("cpu")
        self.rank, self.world_size = rank, world_size


def tiny_gpt2(seed: int = 0, dropout: float = 0.1):
    """A 2-layer GPT-2 with dropout in embeddings, attention and residuals."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=61,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(cfg)


def opt_state_tensors(opt_state) -> dict:
    """Every tensor in an optimizer state, by checkpoint path (for bitwise comparisons)."""
    return {p: v for p, v in ft.checkpoint.flatten_tree(opt_state).items() if torch.is_tensor(v)}


def train_steps(state, data, steps, *, loss_fn=None, batch_size=4, accum=2, lr=1e-2, max_norm=0.3):
    """The README loop until `state.step == steps` (across epochs), at a constant `lr`."""
    while state.step < steps:
        for micro in ft.make_batches(data, state, batch_size=batch_size, accum=accum):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, lr=lr, max_norm=max_norm, stats=stats)
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return state


class Hung(BaseException):
    """Raised by `within` when time runs out: a BaseException, so that the code under test
    cannot swallow it (TimeoutError is an OSError, which file-reading code catches)."""


@contextlib.contextmanager
def within(seconds: float, what: str = "the block"):
    """Raise `Hung` instead of hanging when the body blocks (e.g. opening a FIFO); main thread."""

    def expire(*_):
        raise Hung(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tiny_t5(seed: int = 0, vocab_size: int = 16):
    """A 2-layer T5 (pad 0 = decoder start, eos 1), no dropout."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=vocab_size,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(cfg)


def tiny_bert_tagger(seed: int = 0, num_labels: int = 5):
    """A 2-layer BertForTokenClassification over 61 ids (pad 0), no dropout."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
        pad_token_id=0,
    )
    return BertForTokenClassification(cfg)


def digit_tokenizer():
    """A word-level tokenizer over "<pad>"=0, "</s>"=1, "<unk>"=2 and digits 0..9 (ids 3..12),
    built offline (for the HF collators, which pad through a tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{str(d): d + 3 for d in range(10)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def reverse_rows(n: int, seed: int = 0, *, lo: int = 2, hi: int = 7):
    """Seq2seq rows: a digit string (ids 3..12) and its reverse then eos (1) as labels."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(3, 13) for _ in range(rng.randrange(lo, hi))]
        rows.append({"input_ids": ids, "labels": [*ids[::-1], 1]})
    return rows


def edit_state_json(path, mutate) -> None:
    """Edit a checkpoint's state.json with `mutate(meta)` and record its new digest in
    COMMITTED: what someone who can write the folder does (a forged file), or a checkpoint of an
    older ftrain."""
    import hashlib
    import json

    meta = json.loads((path / "state.json").read_text())
    mutate(meta)
    (path / "state.json").write_text(json.dumps(meta))
    digest = hashlib.sha256((path / "state.json").read_bytes()).hexdigest()
    (path / "COMMITTED").write_text(json.dumps({"state.json": digest}))


def load_example(name: str):
    """examples/<name>.py as a module (registered in sys.modules: its dataclasses need it)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Everything `from_env`, `export_launcher_env` and the trackers' rank rule read to tell who
# started the process (launchers', schedulers' and MPI's variables).
LAUNCHER_VARS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "GROUP_WORLD_SIZE", "RAY_RAYLET_PID", "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR",
    "PET_MASTER_PORT", "PET_NPROC_PER_NODE", "JOB_COMPLETION_INDEX", "SLURM_JOB_ID",
    "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURMD_NODENAME", "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_PTY_PORT",
)  # fmt: skip


def id_rows(n: int) -> list[dict[str, list[int]]]:
    """n one-token rows whose token is the row's number + 1: which rows a step read, by id."""
    return [{"input_ids": [i + 1]} for i in range(n)]


def id_loss(model, batch):
    """A loss over `id_rows` batches for `torch.nn.Linear(1, 1)`: the outputs' sum, one item a
    row."""
    return model(batch["input_ids"].float()).sum(), batch["input_ids"].shape[0]


def batch_ids(micro) -> list[float]:
    """The row tokens of the micro-batches, in order (ZeroWeight stand-ins read none)."""
    import ftrain as ft

    return [
        x
        for b in micro
        if not isinstance(b, ft.data.ZeroWeight)
        for x in b["input_ids"].flatten().tolist()
    ]


def linear_state():
    """A TrainState over `torch.nn.Linear(1, 1)` and SGD, seed 0."""
    import ftrain as ft

    return ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)


def rank_rule_over(monkeypatch, values: dict, clear) -> tuple[int, int, list[tuple[dict, str]]]:
    """Over every combination of the launcher variables `values` (None: unset; the names in
    `clear` unset first), whether the trackers' rank rule (`_known_rank`) leaves the rank to be
    taken later wherever `from_env` takes the process for one of several (refuses it, or a
    WORLD_SIZE above 1); asserts it for each. Returns (several, alone: known as rank 0, the
    environments from_env refused with its message)."""
    import itertools
    import multiprocessing

    from ftrain.extras.logging._rank import _known_rank
    from ftrain.strategies._env import _world_size

    monkeypatch.setattr(multiprocessing, "parent_process", lambda: None)
    several = alone = 0
    refused: list[tuple[dict, str]] = []
    for combo in itertools.product(*values.values()):
        env = {k: v for k, v in zip(values, combo, strict=True) if v is not None}
        with monkeypatch.context() as m:
            for name in clear:
                m.delenv(name, raising=False)
            for name, value in env.items():
                m.setenv(name, value)
            try:
                one_of_several = _world_size() > 1
            except ValueError as e:
                refused.append((env, str(e)))
                one_of_several = True
            known = _known_rank(None)
        if one_of_several:
            several += 1
            assert known is None, f"{env}: from_env takes it for one of several"
        alone += known == 0
    return several, alone, refused


def id_step(state, micro):
    """One README step over `micro` with `id_loss` (lr 0.1); returns the new state."""
    import ftrain as ft

    grads, stats = ft.accumulate_grads(state, micro, id_loss)
    return ft.clip_and_step(state, grads, lr=0.1, stats=stats)[0]


def hold_background_writes(monkeypatch, *, then_fail: bool = False):
    """Background saves stay mid-write (in their writer thread) until the returned event is
    set; with `then_fail`, the write then fails as a full disk does."""
    import threading

    from ftrain.checkpoint import _save

    release = threading.Event()
    real = _save.write_safetensors

    def slow(tensors, path):
        if threading.current_thread().name == "ftrain-checkpoint":
            release.wait(30)
            if then_fail:
                raise OSError(28, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(_save, "write_safetensors", slow)
    return release


class WorkerSeeded(torch.utils.data.Dataset):
    """`n` rows drawn from a numpy generator each DataLoader worker builds once from its seed
    (`get_worker_info().seed`) and keeps across items: a dataset's own per-worker generator."""

    def __init__(self, n: int):
        self.n, self.rng = n, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import numpy as np

        if self.rng is None:
            self.rng = np.random.default_rng(torch.utils.data.get_worker_info().seed)
        return {"x": float(self.rng.random())}
