"""The cluster engines read wrong, third round (examples/cluster, ftrain.extras.ray): a world
size that does not divide the example's global batch, a reported `step` metric that Ray and the
checkpoint disagree on, torchrun's 30 s shutdown inside the pod's grace period, the Ray
example's documented flags."""

from __future__ import annotations

import pytest
import torch
import yaml

import ftrain as ft
from cluster_launch import ROOT, load_example
from ftrain.extras import ray as ray_ft

train = load_example("train")


class ThreeRanks(ft.strategies.SingleDevice):
    """A strategy that says it is rank 0 of 3 (nothing runs a collective before the check)."""

    world_size = 3


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_by_name():
    """GLOBAL_BATCH=4 on 3 ranks gave each rank 4 // 3 = 1 row: a global batch of 3, not 4,
    without a word (and another data order than the run it resumes)."""
    state = train.build(ThreeRanks("cpu"))
    with pytest.raises(ValueError, match=r"GLOBAL_BATCH=4 .* 3 ranks"):
        train.loop(state, 2, save=lambda s: None, save_every=1)
    assert state.step == 0  # refused before any step


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_world_size_that_divides_the_global_batch_gives_each_rank_its_share(world):
    assert train.per_rank_batch(world) * world == train.GLOBAL_BATCH


@pytest.fixture
def fake_worker(monkeypatch):
    """ray.train as a worker sees it, with `report` recording its calls (no cluster)."""
    import ray.train

    from ftrain.process_state import STATE

    reports = []
    monkeypatch.setattr(STATE, "ray_reported", None)
    worker = {"get_world_rank": int, "get_experiment_name": staticmethod(lambda: "run")}
    monkeypatch.setattr(ray.train, "get_context", lambda: type("C", (), worker))
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kw: reports.append((metrics, kw)))
    return reports


def test_a_step_metric_other_than_the_states_step_is_refused_not_overwritten(tmp_path, fake_worker):
    """metrics={"step": 7} at state.step 2 was kept as 7 in the checkpoint and reported to Ray
    as 2: the two records of one checkpoint disagreed without a word."""
    state = train.build().replace(step=2)
    with pytest.raises(ValueError, match=r"metrics\['step'\]=7 .* state\.step=2"):
        ray_ft.save_and_report(state, tmp_path, metrics={"step": 7, "loss": 1.0})
    assert fake_worker == [] and not list(tmp_path.iterdir())  # refused before saving
    path = ray_ft.save_and_report(state, tmp_path, metrics={"step": torch.tensor(2), "loss": 1.0})
    ((metrics, _),) = fake_worker
    assert metrics == {"step": 2, "loss": 1.0}
    assert ft.checkpoint.read_meta(path)["metrics"] == {"step": 2, "loss": 1.0}


def test_the_pytorchjob_lets_torchrun_wait_for_the_save_through_the_pods_grace():
    """Kubernetes sends SIGTERM to torchrun (the pod's command), which forwards it and SIGKILLs
    its workers `--shutdown-timeout` seconds later (30 by default), whatever
    terminationGracePeriodSeconds says: the manifest promised 120 s to save and gave 30."""
    from torch.distributed.run import get_args_parser

    job = yaml.safe_load((ROOT / "examples" / "cluster" / "pytorchjob.yaml").read_text())
    for name, spec in job["spec"]["pytorchReplicaSpecs"].items():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        args = get_args_parser().parse_args(container["command"][1:])
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        timeout = args.shutdown_timeout
        if timeout is None:
            timeout = int(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        grace = pod["terminationGracePeriodSeconds"]
        # Most of the grace for the workers, a little for torchrun to exit before the SIGKILL.
        assert grace - 30 <= timeout < grace, (name, timeout, grace)


def test_the_ray_examples_documented_flags_reach_the_trainer(monkeypatch):
    """train_ray.py's docstring names --save-every and --max-failures; the parser had neither."""
    train_ray = load_example("train_ray")
    seen = {}

    class Fit:
        def fit(self):
            return type("Result", (), {"checkpoint": None})

    def trainer(storage, name, **kw):
        seen.update(kw, storage=storage, name=name)
        return Fit()

    monkeypatch.setattr(train_ray, "trainer", trainer)
    monkeypatch.setattr(train_ray.ray, "init", lambda **kw: None)
    monkeypatch.setattr(train_ray.ray, "shutdown", lambda: None)
    argv = ["/s", "--save-every", "3", "--max-failures", "5", "--keep-last", "4", "--steps", "9"]
    assert train_ray.main(argv) == 0
    assert {k: seen[k] for k in ("save_every", "max_failures", "keep_last", "steps")} == {
        "save_every": 3, "max_failures": 5, "keep_last": 4, "steps": 9}  # fmt: skip


@pytest.fixture
def ranked_by(monkeypatch):
    """Ray's worker context of a run whose RunConfig ranks checkpoints by a metric."""
    import ray.train
    from ray.train.v2._internal.execution import context

    def rank_by(metric, mode="min"):
        config = ray.train.CheckpointConfig(
            num_to_keep=1, checkpoint_score_attribute=metric, checkpoint_score_order=mode
        )
        run = type("Run", (), {"checkpoint_config": config})
        ctx = type("Ctx", (), {"train_run_context": type("T", (), {"run_config": run})})
        monkeypatch.setattr(context, "get_train_context", lambda: ctx)

    return rank_by


def test_a_save_without_the_metric_ray_ranks_by_is_refused_not_ranked_best(
    tmp_path, fake_worker, ranked_by
):
    """Ray scores a checkpoint reported without `checkpoint_score_attribute` as -inf, which in
    mode "min" is the best: a preemption save with metrics={} became the one best checkpoint
    Ray keeps, and the real best was deleted (Ray only logged an error in its controller)."""
    ranked_by("eval_loss")
    state = train.build().replace(step=3)
    with pytest.raises(ValueError, match=r"metrics lack 'eval_loss', the metric Ray ranks"):
        ray_ft.save_and_report(state, tmp_path, metrics={"loss": 1.0})
    assert fake_worker == [] and not list(tmp_path.iterdir())  # refused before saving
    ray_ft.save_and_report(state, tmp_path, metrics={"eval_loss": float("nan")})  # unranked
    ray_ft.save_and_report(state.replace(step=4), tmp_path, metrics={"eval_loss": 0.5})
    assert [m["step"] for m, _ in fake_worker] == [3, 4]


class Rank1(ft.strategies.SingleDevice):
    """Rank 1 of a group whose rank 0 voted `refused` in the save's all-reduce."""

    refused = 0.0  # set after TrainState.create, whose own checks vote too

    @property
    def process_rank(self) -> int:
        return 1

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.refused


def test_rank_0s_metrics_are_checked_and_every_rank_refuses_together(
    tmp_path, fake_worker, ranked_by, monkeypatch
):
    """Rank 0's metrics are the ones kept and reported (other ranks may pass none): a rank that
    raised alone would leave the others waiting in the save's collectives."""
    import ray.train

    worker = {"get_world_rank": staticmethod(lambda: 1),
              "get_experiment_name": staticmethod(lambda: "run")}  # fmt: skip
    monkeypatch.setattr(ray.train, "get_context", lambda: type("C", (), worker))
    ranked_by("eval_loss")
    strategy = Rank1("cpu")
    state = train.build(strategy).replace(step=5)
    ray_ft.save_and_report(state, tmp_path, metrics={"step": 9})  # rank 0 said its were fine
    strategy.refused = 1.0
    state = state.replace(step=6)
    with pytest.raises(ValueError, match=r"rank 0 refused its metrics .* no rank saved"):
        ray_ft.save_and_report(state, tmp_path, metrics={"eval_loss": 1.0})
    assert not (tmp_path / "run" / "report-6").exists()


def test_the_ray_examples_trainer_refuses_a_hook_it_does_not_call():
    """`trainer(**hooks)` put any keyword into the workers' config: a misspelt `on_stpe=` was
    carried along and never called."""
    train_ray = load_example("train_ray")
    with pytest.raises(TypeError, match=r"on_stpe.*on_step, log"):
        train_ray.trainer("/s", "run", on_stpe=print)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "5"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_in_the_main_thread_too(bad):
    """In the main thread `run_in_main_thread` just runs the call: a timeout_s of -1 or "5"
    went unread there, and failed as a misleading TimeoutError from Ray's thread."""
    with pytest.raises(ValueError, match=r"timeout_s must be a number > 0"):
        ray_ft.run_in_main_thread(lambda: None, timeout_s=bad)
    with pytest.raises(ValueError, match=r"timeout_s must be a number > 0"):
        ray_ft.on_preemption(timeout_s=bad)


def test_a_state_that_does_not_span_rays_group_is_refused_before_it_reports(
    tmp_path, fake_worker, monkeypatch
):
    """Ray worker 1 with a state on SingleDevice() (TrainState.create's own suggestion for
    "train each alone"): it said process rank 0, so it reported a checkpoint of its own, and
    Ray merged every worker's files into one step-N folder."""
    import ray.train

    worker = type("C", (), {"get_world_rank": lambda self: 1, "get_world_size": lambda self: 2})
    monkeypatch.setattr(ray.train, "get_context", lambda: worker())
    state = train.build(ft.strategies.SingleDevice("cpu"))
    with pytest.raises(
        RuntimeError, match=r"process rank 0, but this is Ray Train worker 1 of 2.*from_env"
    ):
        ray_ft.save_and_report(state, tmp_path)
    assert fake_worker == [] and not list(tmp_path.iterdir())
