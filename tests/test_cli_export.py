"""`python -m ftrain export` of a run trained with an EMA (which weights: asked, never guessed),
and folders that never were checkpoints (said so, not "save cut short")."""

from __future__ import annotations

import shutil

import pytest
import torch

import ftrain as ft
from ftrain.extras.cli import main
from helpers import ragged_rows, tiny_llama

ROWS = ragged_rows(8, seed=1)


def _trained(optimizer, strategy=None):
    state = ft.TrainState.create(tiny_llama(), optimizer, strategy=strategy)
    for micro in ft.make_batches(ROWS, batch_size=4, accum=1, seed=0):
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.5)
    return state


def _ema():
    return ft.optim.ema(ft.optim.sgd(), decay=0.5, warmup=False)


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 5, 9, 13, 2, 7]])).logits


def _exported(directory):
    from transformers import AutoModelForCausalLM

    return _logits(AutoModelForCausalLM.from_pretrained(directory))


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """A checkpoint of a run trained with an EMA, and the logits of its live and EMA weights."""
    state = _trained(_ema())
    live = _logits(state.model)
    with ft.optim.swap_ema(state):
        average = _logits(state.model)
    assert not torch.allclose(live, average)  # else the tests below could not tell them apart
    return ft.save_checkpoint(state, tmp_path_factory.mktemp("ema")), live, average


# --- which weights of an EMA run -----------------------------------------------------------------


def test_export_of_an_ema_run_asks_which_weights(ema_run, tmp_path, capsys):
    """Was: exported the live weights without a word, while eval had used the average."""
    path, _, _ = ema_run
    with pytest.raises(SystemExit) as e:
        main(["export", str(path), "--to", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "was trained with ft.optim.ema" in err
    assert "--weights ema" in err and "--weights live" in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="which one to export is not guessed"):
        ft.export_checkpoint(path, tmp_path / "hf")


@pytest.mark.parametrize("weights", ["ema", "live"])
def test_export_weights_writes_the_weights_named(ema_run, tmp_path, capsys, weights):
    path, live, average = ema_run
    out = tmp_path / "hf"
    assert main(["export", str(path), "--to", str(out), "--weights", weights]) == 0
    which = {"ema": "the EMA weights", "live": "the live weights"}[weights]
    assert f"({which}) -> {out}" in capsys.readouterr().out
    assert torch.equal(_exported(out), average if weights == "ema" else live)


def test_weights_ema_of_a_run_without_an_ema_is_refused(tmp_path, capsys):
    path = ft.save_checkpoint(_trained(ft.optim.sgd()), tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        main(["export", str(path), "--to", str(tmp_path / "hf"), "--weights", "ema"])
    assert e.value.code == 2 and "holds no EMA average" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert main(["export", str(path), "--to", str(tmp_path / "hf"), "--weights", "live"]) == 0


@pytest.fixture(scope="module")
def partial_ema_run(tmp_path_factory):
    """A checkpoint whose EMA (inside a partition group) averages the decoder layers only."""
    groups = {"ema": _ema(), "sgd": ft.optim.sgd()}
    optimizer = ft.optim.partition(groups, lambda n: "ema" if "layers" in n else "sgd")
    return ft.save_checkpoint(_trained(optimizer), tmp_path_factory.mktemp("partial"))


def test_weights_ema_refuses_an_average_of_some_parameters_only(partial_ema_run, tmp_path):
    """An EMA inside a partition group averages that group only (swap_ema refuses it too)."""
    path = partial_ema_run
    with pytest.raises(ValueError, match=r"cover \d+ of its \d+ trainable parameters"):
        ft.export_checkpoint(path, tmp_path / "hf", weights="ema")
    with pytest.raises(ValueError, match="not guessed"):
        ft.export_checkpoint(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


class _Sharded(ft.strategies.SingleDevice):
    """The sharded layout (FSDP's) written by one process."""

    checkpoint_sharded = True


def test_weights_ema_reads_the_averages_of_a_sharded_checkpoint(tmp_path):
    state = _trained(_ema(), strategy=_Sharded())
    with ft.optim.swap_ema(state):
        average = _logits(state.model)
    path = ft.save_checkpoint(state, tmp_path / "run")
    assert ft.checkpoint.read_meta(path).get("sharded") is True
    ft.export_checkpoint(path, tmp_path / "hf", weights="ema")
    assert torch.equal(_exported(tmp_path / "hf"), average)


def test_inspect_says_an_ema_run_holds_two_sets_of_weights(ema_run, tmp_path, capsys):
    assert main(["inspect", str(ema_run[0])]) == 0
    assert "EMA average (ft.optim.ema): export --weights ema|live" in capsys.readouterr().out
    plain = ft.save_checkpoint(ft.TrainState.create(tiny_llama(), ft.optim.sgd()), tmp_path)
    assert main(["inspect", str(plain)]) == 0
    assert "EMA" not in capsys.readouterr().out


def test_inspect_of_a_partial_ema_offers_what_export_accepts(partial_ema_run, tmp_path, capsys):
    """Was "export --weights ema|live", and export --weights ema then refused it."""
    path = partial_ema_run
    names = [row[0] for row in ft.checkpoint.read_meta(path)["params"]]
    covered, trainable = sum("layers" in n for n in names), len(names)
    assert main(["inspect", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("weights"))
    assert f"EMA averages of {covered} of {trainable} trainable parameters" in line, line
    assert line.endswith("export --weights live") and "ema|live" not in line
    for weights in ([], ["--weights", "ema"]):
        with pytest.raises(SystemExit) as e:
            main(["export", str(path), "--to", str(tmp_path / "hf"), *weights])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{covered} of its {trainable} trainable" in err
        assert "pass --weights live" in err and "usage:" in err
    assert main(["export", str(path), "--to", str(tmp_path / "hf"), "--weights", "live"]) == 0


@pytest.mark.parametrize("config", ["{not json", '{"hidden_size": 8}'])
def test_export_failing_past_its_arguments_says_why_in_one_line(tmp_path, capsys, config):
    """Was: transformers' ValueError for --base became exit 2 with the usage text, as if an
    argument were misspelled, and its OSError a traceback."""
    path = ft.save_checkpoint(ft.TrainState.create(tiny_llama(), ft.optim.sgd()), tmp_path / "r")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(config)
    assert main(["export", str(path), "--to", str(tmp_path / "hf"), "--base", str(base)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: export of {path} failed: ") and str(base) in err
    assert "usage:" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "hf").exists()


# --- not a checkpoint, or a save cut short -------------------------------------------------------


def _load(path):
    return ft.load_checkpoint(path, ft.TrainState.create(tiny_llama(), ft.optim.sgd()))


@pytest.mark.parametrize("contents", [[], ["notes.txt", "data.csv"], ["config.json"]])
def test_a_folder_that_never_was_a_checkpoint_says_so(tmp_path, capsys, contents):
    """Was "incomplete: no COMMITTED marker (save cut short)", as if a save had crashed."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in contents:
        (folder / name).write_text("{}")
    with pytest.raises(ft.CheckpointError, match="mine is not a checkpoint: no COMMITTED") as e:
        _load(folder)
    assert "cut short" not in str(e.value)
    assert main(["inspect", str(folder)]) == 1
    assert main(["export", str(folder), "--to", str(tmp_path / "hf")]) == 1
    said = capsys.readouterr()
    assert "is not a checkpoint" in said.out and "is not a checkpoint" in said.err
    assert "cut short" not in said.out + said.err


def test_a_run_folder_or_its_parent_is_not_a_checkpoint(ema_run, tmp_path, capsys):
    run = tmp_path / "runs" / "a"
    shutil.copytree(ema_run[0], run / ema_run[0].name)
    with pytest.raises(ft.CheckpointError, match=f"it is a run folder: .*{ema_run[0].name}"):
        _load(run)
    assert main(["export", str(run.parent), "--to", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "runs is not a checkpoint" in err and "is a folder of run folders: " in err
    assert f"e.g. of {run}\n" in err
    assert "cut short" not in err


def test_a_save_cut_short_is_still_called_so(ema_run, tmp_path):
    """What a crash leaves: the save's temporary folder (tensors written, no state.json, no
    marker), or a published folder whose marker is gone."""
    tmp = tmp_path / ".tmp-step-2.123@host.0123abcd"
    tmp.mkdir()
    for name in ("model.safetensors", "optimizer.safetensors"):
        shutil.copy(ema_run[0] / name, tmp / name)
    with pytest.raises(ft.CheckpointError, match=r"incomplete: no COMMITTED marker \(save cut"):
        _load(tmp)
    shutil.rmtree(tmp)
    tmp.mkdir()  # a save killed before it wrote anything
    with pytest.raises(ft.CheckpointError, match=r"\(save cut short\)"):
        _load(tmp)
    copy = shutil.copytree(ema_run[0], tmp_path / "step-2")
    (copy / "COMMITTED").unlink()
    with pytest.raises(ft.CheckpointError, match=r"incomplete: no COMMITTED marker \(save cut"):
        _load(copy)


# --- ft.export_pretrained of an EMA state: the same question as the CLI's ------------------------


def _ema_state():
    state = _trained(_ema())
    live = _logits(state.model)
    with ft.optim.swap_ema(state):
        average = _logits(state.model)
    assert not torch.allclose(live, average)
    return state, live, average


def test_export_pretrained_of_an_ema_state_asks_which_weights(tmp_path):
    """Was: wrote the live weights without a word outside swap_ema (as the CLI did)."""
    state, live, average = _ema_state()
    with pytest.raises(ValueError, match=r"not guessed: pass weights='ema'.*weights='live'"):
        ft.export_pretrained(state, tmp_path / "none")
    assert not (tmp_path / "none").exists()
    torch.testing.assert_close(
        _exported(ft.export_pretrained(state, tmp_path / "e", weights="ema")), average
    )
    torch.testing.assert_close(
        _exported(ft.export_pretrained(state, tmp_path / "l", weights="live")), live
    )
    torch.testing.assert_close(_logits(state.model), live)  # the live weights are back
    with ft.optim.swap_ema(state):  # the model holds the average: written as it is
        torch.testing.assert_close(_exported(ft.export_pretrained(state, tmp_path / "s")), average)
        torch.testing.assert_close(
            _exported(ft.export_pretrained(state, tmp_path / "se", weights="ema")), average
        )
        with pytest.raises(ValueError, match=r"weights='live'\) inside ft.optim.swap_ema"):
            ft.export_pretrained(state, tmp_path / "sl", weights="live")
    with pytest.raises(ValueError, match="weights must be 'ema', 'live' or None, got 'EMA'"):
        ft.export_pretrained(state, tmp_path / "bad", weights="EMA")


def test_export_pretrained_weights_ema_needs_a_whole_average(tmp_path):
    plain = _trained(ft.optim.sgd())
    ft.export_pretrained(plain, tmp_path / "a")  # only live weights: nothing to ask
    ft.export_pretrained(plain, tmp_path / "b", weights="live")
    with pytest.raises(ValueError, match=r"holds no EMA average.*export weights='live'"):
        ft.export_pretrained(plain, tmp_path / "c", weights="ema")
    labels = lambda name: "embed" if "embed" in name else "rest"  # noqa: E731
    grouped = _trained(ft.optim.partition({"embed": _ema(), "rest": ft.optim.sgd()}, labels))
    with pytest.raises(ValueError, match="not guessed"):
        ft.export_pretrained(grouped, tmp_path / "d")
    with pytest.raises(ValueError, match=r"inside another optimizer \(a partition group\?\)"):
        ft.export_pretrained(grouped, tmp_path / "e", weights="ema")
    ft.export_pretrained(grouped, tmp_path / "f", weights="live")


def _linear_run(root, steps):
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    for step in steps:
        ft.save_checkpoint(state.replace(step=step), root)
    return root


def test_a_run_folder_names_a_committed_checkpoint_or_says_none_is(tmp_path, capsys):
    """Was "pass one of its checkpoints, e.g. .../step-3" for a step-3 without a marker."""
    run = _linear_run(tmp_path / "run", [1])
    (run / "step-3").mkdir()  # newer, not committed
    with pytest.raises(ft.CheckpointError, match=r"run folder: pass .*, e\.g\. \S*step-1 \("):
        ft.checkpoint.open_checkpoint(run)
    shutil.rmtree(run / "step-1")
    with pytest.raises(ft.CheckpointError) as e:
        ft.checkpoint.open_checkpoint(run)
    assert "no committed checkpoint in it: step-3 is a save cut short" in str(e.value)
    assert "e.g." not in str(e.value)
    assert main(["export", str(run), "--to", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "no committed checkpoint in it: step-3 is a save cut short" in err
    assert "step-<N> (the newest" not in err


def test_a_folder_with_a_checkpoints_model_files_only_is_a_save_cut_short(tmp_path):
    """Was "a checkpoint is a step-<N> folder that ft.save_checkpoint wrote" for step-7."""
    model = _linear_run(tmp_path / "run", [0]) / "step-0"
    cases = {"step-7": ["model.safetensors"], "copy": ["model.safetensors"], "sharded": ["model"]}
    for name, contents in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        for item in contents:
            if item == "model":
                (folder / item).mkdir()
            else:
                shutil.copy(model / item, folder / item)
        with pytest.raises(ft.CheckpointError, match=r"incomplete: no COMMITTED marker \(save cut"):
            ft.checkpoint.open_checkpoint(folder)
    (tmp_path / "step-8").mkdir()  # a step folder with nothing in it
    with pytest.raises(ft.CheckpointError, match=r"step-8 is incomplete: no COMMITTED marker"):
        ft.checkpoint.open_checkpoint(tmp_path / "step-8")


def test_an_hf_model_directory_is_not_a_save_cut_short(tmp_path):
    hf = ft.export_pretrained(ft.TrainState.create(tiny_llama(), ft.optim.sgd()), tmp_path / "hf")
    with pytest.raises(ft.CheckpointError, match="hf is not a checkpoint") as e:
        ft.checkpoint.open_checkpoint(hf)
    assert "make it an HF model directory" in str(e.value) and "cut short" not in str(e.value)


def test_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    """Was "not a checkpoint directory" for a typo, as if the folder held something else."""
    missing = tmp_path / "step-9"
    with pytest.raises(ft.CheckpointError, match=r"step-9 is not a checkpoint directory: it does"):
        ft.checkpoint.open_checkpoint(missing)
    (tmp_path / "link").symlink_to(missing)
    with pytest.raises(ft.CheckpointError, match=f"link to {missing}, which does not exist"):
        ft.checkpoint.open_checkpoint(tmp_path / "link")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ft.CheckpointError, match="file is not a checkpoint directory: it is a f"):
        ft.checkpoint.open_checkpoint(tmp_path / "file")
    assert main(["inspect", str(missing)]) == 1
    assert f"{missing} is not a checkpoint directory: it does not exist" in capsys.readouterr().out


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1],
                          num_labels=2)  # fmt: skip
    return ResNetForImageClassification(config)


def test_exporting_the_ema_of_a_batchnorm_model_asks_for_the_live_statistics(tmp_path, capsys):
    """The average went out beside BatchNorm's live running statistics (ft.optim.ema does not
    average them), without a word; swap_ema refuses the same, and both take live_buffers."""
    state = ft.TrainState.create(_resnet(), _ema())
    batch = {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.tensor([0, 1, 1, 0])}

    def loss_fn(model, b):  # an image classifier: its own loss (a mean) over its rows
        return model(**b).loss * 4, torch.tensor(4.0)

    grads, stats = ft.accumulate_grads(state, [batch], loss_fn)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.5)
    path = ft.save_checkpoint(state, tmp_path / "run")
    out = tmp_path / "hf"
    assert main(["export", str(path), "--to", str(out), "--weights", "ema"]) == 1
    err = capsys.readouterr().err
    assert "holds running statistics" in err and "export --live-buffers" in err
    assert not out.exists()
    with pytest.raises(SystemExit) as e:
        main(["export", str(path), "--to", str(out), "--weights", "live", "--live-buffers"])
    assert e.value.code == 2 and "--live-buffers without --weights ema" in capsys.readouterr().err
    with pytest.raises(ValueError, match="live_buffers=True with weights='live'"):
        ft.export_checkpoint(path, out, weights="live", live_buffers=True)
    args = ["export", str(path), "--to", str(out), "--weights", "ema", "--live-buffers"]
    assert main(args) == 0
    from safetensors.torch import load_file

    written = load_file(out / "model.safetensors")
    model = state.model
    for name, t in model.named_buffers():
        if name.endswith("running_mean"):
            assert torch.equal(written[name], t), name  # the live statistics, as asked
    averaged = state.opt_state.ema
    assert all(torch.equal(written[n], averaged[n]) for n in averaged if n in written)
    assert any(not torch.equal(averaged[n], state.params[n]) for n in averaged)


def test_export_pretrained_of_a_batchnorm_models_ema_takes_live_buffers(tmp_path):
    """export_pretrained(weights="ema") raised swap_ema's refusal ("Pass swap_ema(state,
    live_buffers=True)"), which it had no argument to follow."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    state = ft.TrainState.create(model, _ema())
    with torch.no_grad():
        model[1].running_mean.fill_(3.0)
        for a in state.opt_state.ema.values():
            a.fill_(7.0)
    out = tmp_path / "hf"
    want = (
        r"export_pretrained\(weights='ema'\): .*\['1\.running_mean', '1\.running_var'\]"
        r".* Pass live_buffers=True"
    )
    with pytest.raises(ValueError, match=want):
        ft.export_pretrained(state, out, weights="ema")
    with pytest.raises(
        ValueError, match=r"export_pretrained got live_buffers=True with weights='live'"
    ):
        ft.export_pretrained(state, out, weights="live", live_buffers=True)
    assert not out.exists()
    ft.export_pretrained(state, out, weights="ema", live_buffers=True)
    from safetensors.torch import load_file

    written = load_file(out / "model.safetensors")
    assert all(torch.all(written[n] == 7.0) for n in state.opt_state.ema)  # the average
    assert torch.all(written["1.running_mean"] == 3.0)  # the live statistics, as asked
    assert not torch.all(state.params["0.weight"] == 7.0)  # the live weights are back
