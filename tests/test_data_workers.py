"""make_batches with DataLoader workers: same groups for any worker count, seeded randomness,
O(1) start, no leaked process, worker errors with their traceback, and argument errors."""

import gc
import multiprocessing
import random
import socket
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import ftrain as ft
from helpers import FakeRank, WorkerSeeded


class Augmented(torch.utils.data.Dataset):
    """Rows drawn with torch, `random` and numpy's global generator (a random augmentation);
    reading a row listed in `forbidden` fails, in a worker or not."""

    def __init__(self, n, forbidden=()):
        self.n, self.forbidden = n, set(forbidden)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.forbidden:
            raise ValueError(f"row {i} must not be read")
        noise = [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]
        return {"idx": i, "noise": noise}


def _flat(groups):
    return [(b["idx"].tolist(), b["noise"].tolist()) for g in groups for b in g]


def _batches(data, **kw):
    kw = {"batch_size": 3, "accum": 2, "seed": 4, **kw}
    return list(ft.make_batches(data, **kw))


@pytest.fixture(scope="module")
def reference():
    return _flat(_batches(Augmented(20), epoch=1))


# torch warns when there are more workers than cores (8 on a 2-core CI machine): on purpose here.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("workers", [1, 2, 8])
def test_any_worker_count_yields_the_in_process_groups(reference, workers):
    got = _batches(Augmented(20), epoch=1, num_workers=workers, prefetch_factor=1)
    assert [len(g) for g in got] == [2, 2, 2, 1]
    assert _flat(got) == reference


def test_augmentation_randomness_depends_on_epoch_and_rank_not_on_the_caller(reference):
    torch.manual_seed(123)
    random.seed(5)
    before = torch.rand(1), random.random()
    again = _flat(_batches(Augmented(20), epoch=1))
    assert again == reference
    other = _flat(_batches(Augmented(20), epoch=2))
    assert [n for _, n in other] != [n for _, n in reference]
    # The caller's generators are left where they were.
    torch.manual_seed(123)
    random.seed(5)
    assert (torch.rand(1), random.random()) == before
    ranks = [_flat(_batches(Augmented(20), batch_size=2, strategy=FakeRank(r, 2))) for r in (0, 1)]
    assert ranks[0][0][1] != ranks[1][0][1]


def test_a_collator_with_a_generator_of_its_own_is_refused_and_works_without_its_seed():
    """DataCollatorForLanguageModeling(seed=...), HF's way to reproducible masking, draws from
    its own generator: under make_batches its masks restarted at a resume, were the same on
    every rank, and changed with num_workers. Without a seed it draws from the generators
    make_batches seeds per micro-batch, and is all three."""
    from transformers import DataCollatorForLanguageModeling

    text = (Path(__file__).parent.parent / "examples" / "data" / "tinyshakespeare.txt").read_text()
    tok = ft.sft.train_tokenizer(text[:50_000].split("\n\n"), vocab_size=200)
    tok.add_special_tokens({"mask_token": "[MASK]"})
    rows = [{"input_ids": list(range(3, 19))} for _ in range(16)]

    def masks(collator, rank=0, **kw):
        groups = ft.make_batches(
            rows, batch_size=4, collate_fn=collator, strategy=FakeRank(rank, 2), **kw
        )
        return [(b["labels"] != -100).tolist() for g in groups for b in g]

    with pytest.raises(ValueError, match=r"DataCollatorForLanguageModeling\) draws from a gen"):
        masks(DataCollatorForLanguageModeling(tok, mlm=True, seed=0))
    collator = DataCollatorForLanguageModeling(tok, mlm=True)
    run = masks(collator)
    assert masks(collator, start=1) == run[1:]  # a resume draws the same masks
    assert masks(collator, num_workers=2) == run
    assert masks(collator, rank=1)[0] != run[0]  # and ranks draw their own


def test_a_causal_lm_collator_with_a_seed_is_accepted_as_it_draws_nothing():
    """DataCollatorForLanguageModeling(mlm=False, seed=42) copies input_ids into the labels and
    never draws from its generator: it was refused as one that does."""
    from transformers import DataCollatorForLanguageModeling

    text = (Path(__file__).parent.parent / "examples" / "data" / "tinyshakespeare.txt").read_text()
    tok = ft.sft.train_tokenizer(text[:50_000].split("\n\n"), vocab_size=200)
    rows = [{"input_ids": list(range(3, 19))} for _ in range(16)]
    collator = DataCollatorForLanguageModeling(tok, mlm=False, seed=42)
    labels = [
        b["labels"].tolist()
        for g in ft.make_batches(rows, batch_size=4, collate_fn=collator)
        for b in g
    ]
    assert labels == [[list(range(3, 19))] * 4] * 4


def test_resume_with_workers_equals_the_uninterrupted_run_and_never_reads_skipped_rows(reference):
    order = [i for ids, _ in reference for i in ids]
    skipped = order[: 3 * 3]  # start=3 micro-batches of 3 rows
    resumed = _batches(Augmented(20, forbidden=skipped), epoch=1, start=3, num_workers=2)
    assert _flat(resumed) == reference[3:]


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_workers_end_when_the_loop_breaks_or_the_iterator_is_dropped():
    before = _children()
    for i, _ in enumerate(ft.make_batches(Augmented(40), batch_size=2, num_workers=2)):
        assert len(_children() - before) == 2
        if i == 1:
            break  # max_steps reached mid-epoch
    assert _children() == before
    it = ft.make_batches(Augmented(40), batch_size=2, num_workers=2)
    next(it)
    del it
    gc.collect()
    assert _children() == before


def test_a_worker_exception_surfaces_with_the_worker_traceback():
    with pytest.raises(ValueError, match="row 7 must not be read") as e:
        _batches(Augmented(20, forbidden=[7]), shuffle=False, num_workers=2)
    assert "in DataLoader worker process" in str(e.value)
    assert "__getitem__" in str(e.value)  # the worker's own traceback


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"num_workers": -1}, ValueError, "num_workers"),
        ({"prefetch_factor": 2}, ValueError, "prefetch_factor"),
        ({"num_workers": 1, "prefetch_factor": 0}, ValueError, "prefetch_factor"),
        ({"seed": "1"}, TypeError, "seed"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"epoch": 2.0}, TypeError, "epoch"),
        ({"epoch": -1}, ValueError, "epoch"),
        ({"start": 8}, ValueError, "start=8 is beyond the epoch's 7 micro-batches"),
    ],
)
def test_bad_arguments_name_themselves(kw, error, match):
    with pytest.raises(error, match=match):
        ft.make_batches(Augmented(20), batch_size=3, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pin_memory_without_cuda_raises():
    with pytest.raises(ValueError, match="pin_memory"):
        ft.make_batches(Augmented(4), batch_size=2, pin_memory=True)


def test_empty_epoch_raises_instead_of_spinning_the_loop():
    with pytest.raises(ValueError, match="data is empty"):
        ft.make_batches([], batch_size=2)
    with pytest.raises(ValueError, match="drop_last=True leaves no micro-batch: 3 rows"):
        ft.make_batches(Augmented(3), batch_size=2, drop_last=True, strategy=FakeRank(0, 2))
    # start == the epoch's length is a resume at the epoch's end: nothing left, no error.
    assert list(ft.make_batches(Augmented(4), batch_size=2, start=2)) == []
    assert list(ft.make_batches(np.arange(4), batch_size=2, seed=np.int64(3)))


def _rank_main(rank, port, queue):
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        ft.make_batches(list(range(8)), batch_size=2)
        queue.put((rank, "no error"))
    except ValueError as e:
        queue.put((rank, str(e)))
    finally:
        torch.distributed.destroy_process_group()


def test_no_strategy_under_a_process_group_raises_naming_strategy():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        assert "strategy is None under an initialised process group of 2" in results[rank]


class AugmentedStream(torch.utils.data.IterableDataset):
    """A stream whose rows draw from torch, `random` and numpy's global generator."""

    def __iter__(self):
        for i in range(17):
            yield {"idx": i, "noise": [*torch.rand(2).tolist(), random.random(), np.random.rand()]}


def _draw():
    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


@pytest.mark.parametrize("kind", ["map", "stream", "mix"])
def test_the_loop_draws_from_its_own_generators_between_groups(kind):
    """Rows and collation draw from the three global generators seeded per micro-batch (and per
    row of a stream), saved once a group (a stream: once a micro-batch) and put back before the
    group reaches the loop: the loop's own draws between groups (numpy's too) are those it would
    make without make_batches, and the groups are those of workers, which never touch the loop's
    generators."""
    data = {
        "map": lambda: Augmented(20),
        "stream": AugmentedStream,
        "mix": lambda: ft.data.mix([AugmentedStream(), AugmentedStream()], weights=[1, 2]),
    }[kind]

    def run(**kw):
        torch.manual_seed(3), random.seed(3), np.random.seed(3)
        groups, draws = [], []
        for g in ft.make_batches(data(), batch_size=3, accum=3, seed=4, **kw):
            groups.append([b["noise"].tolist() for b in g])
            draws.append(_draw())
        return groups, draws

    groups, draws = run()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    assert draws == [_draw() for _ in draws]
    assert len(groups) >= 2 and len({str(b) for g in groups for b in g}) == sum(map(len, groups))
    assert run(num_workers=2, prefetch_factor=1) == (groups, draws)  # the loop's draws too


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_pinning_in_process_yields_the_groups_and_leaves_the_loops_generators(monkeypatch):
    """`pin_memory=True` without workers: DataLoader pins (in this process) what the in-process
    path collates, a group under one save of the generators. On this CPU-only machine
    DataLoader cannot pin (it warns and passes the batches on): the route is what is checked
    here, the pinning by tests/test_gpu.py."""
    want = _flat(_batches(Augmented(20), epoch=1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # make_batches' own check
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    groups, draws = [], []
    for g in ft.make_batches(Augmented(20), batch_size=3, accum=2, seed=4, epoch=1,
                             pin_memory=True):  # fmt: skip
        groups.append(g)
        draws.append(_draw())
    assert _flat(groups) == want
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    assert draws == [_draw() for _ in draws]


def test_workers_seeds_follow_the_run_seed_and_the_epoch():
    """Workers' own seeds (`get_worker_info().seed`) come from (seed, epoch, rank): a dataset's
    generator seeded from them draws anew each epoch and run, and the same again for the same
    ones. (Fixed at one base seed, the review's catch, every epoch and run drew alike.)"""

    def draws(seed, epoch):
        groups = ft.make_batches(WorkerSeeded(8), batch_size=2, seed=seed, epoch=epoch,
                                 shuffle=False, num_workers=2, prefetch_factor=1)  # fmt: skip
        return [b["x"].tolist() for g in groups for b in g]

    runs = {(s, e): draws(s, e) for s in (0, 1) for e in (0, 1)}
    assert len({str(r) for r in runs.values()}) == 4
    assert draws(1, 1) == runs[1, 1]
