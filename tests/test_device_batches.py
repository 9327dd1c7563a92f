"""The GPU step's parts, proven on the CPU (issue 49): batches made on the device are the
DataLoader's, the schedule table is the eager schedule's rates, the capture wrapper's
warm-up is undone completely (off CUDA it then runs eagerly, bit for bit today's loop), and
the captured step's optimizer and schedule load a checkpoint in place and write one an
eager run loads. tests/test_gpu.py proves the capture itself on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.data import MnistData
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.optim import CapturableAdamW, ScheduleTable, build_optimizer, schedule_table
from raytrain_mnist.worker.batches import DeviceBatches, make_train_loader, set_epoch
from raytrain_mnist.worker.graphs import CAPTURE, EAGER, WARMUP_STEPS, GraphedStep
from raytrain_mnist.worker.resume import checkpoint_state, restore, resume_point
from raytrain_mnist.worker.step import train_step
from raytrain_mnist.worker.training import LOADER, Training, as_is, prepare_training

CPU = torch.device("cpu")
#: fit's default recipe (shifts, label smoothing, one-cycle AdamW) at a tiny size.
CFG = TrainConfig(epochs=2, batch_size=32)
STEPS = 5  # an epoch's, at the full batch


@pytest.fixture(scope="module")
def digits(sample_digits):
    images, labels = (torch.from_numpy(a[: STEPS * CFG.batch_size].copy()) for a in sample_digits)
    return images, labels


def _prepared(loader: DataLoader, rank: int, world: int) -> DataLoader:
    """``loader`` as Ray's prepare_data_loader rebuilds it for ``world`` > 1 (its
    DistributedSampler, shuffled, seed 0; the loader's generator kept)."""
    if world == 1:
        return loader
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        shuffle=False,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        generator=loader.generator,
        sampler=DistributedSampler(loader.dataset, num_replicas=world, rank=rank, shuffle=True),
    )


@pytest.mark.parametrize("world", [1, 2])
def test_device_batches_are_the_loaders_batches_and_draw_what_it_draws(digits, world):
    """For every rank, epoch and seed, the batches made from the epoch's order are the ones
    iterating the loader gives, and every generator is left where that iteration leaves it
    (so the shifts drawn next are the same)."""
    images, labels = digits
    for seed in (0, 7):
        for rank in range(world):
            batch = CFG.batch_size // world
            loaders = [
                _prepared(make_train_loader(images, labels, batch, seed), rank, world)
                for _ in range(2)
            ]
            made = DeviceBatches(loaders[1], images, labels)
            assert made.steps == len(loaders[0]) == STEPS
            for epoch in range(3):
                for loader in loaders:
                    set_epoch(loader, epoch, seed)
                torch.manual_seed(epoch)
                expected = [(x.clone(), y.clone()) for x, y in loaders[0]]
                after_loader = (torch.get_rng_state(), loaders[0].generator.get_state())
                torch.manual_seed(epoch)
                made.load_epoch()
                got = [made.next() for _ in range(made.steps)]
                assert torch.equal(torch.get_rng_state(), after_loader[0])
                assert torch.equal(loaders[1].generator.get_state(), after_loader[1])
                assert int(made.at) == made.steps
                for (x, y), (gx, gy) in zip(expected, got, strict=True):
                    assert torch.equal(x, gx) and torch.equal(y, gy), (seed, rank, epoch)
            # A resume at step 3 gathers the uninterrupted run's fourth batch next.
            for loader in loaders:
                set_epoch(loader, 2, seed)
            made.load_epoch(3)
            assert torch.equal(made.next()[1], list(loaders[0])[3][1])


def _lrs_used(cfg: TrainConfig, steps_per_epoch: int, optimizer, scheduler) -> list[float]:
    """The learning rate each optimizer step of a run uses, stepped as train_step steps."""
    used = []
    for _ in range(cfg.epochs * steps_per_epoch):
        used.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()  # no gradients: nothing moves
        scheduler.step()
    return used


@pytest.mark.parametrize("schedule", ["onecycle", "constant"])
def test_the_schedule_table_is_the_rate_of_every_eager_step(schedule):
    cfg = dataclasses.replace(CFG, epochs=3, schedule=schedule)
    steps = 7
    table = schedule_table(cfg, steps)
    assert table.dtype == torch.float64 and len(table) == cfg.epochs * steps + 1

    eager = build_optimizer(torch.nn.Linear(2, 2), cfg, steps)
    assert _lrs_used(cfg, steps, *eager) == table[:-1].tolist()
    assert eager[1].get_last_lr()[0] == table[-1].item()

    # The captured step's schedule: the same rates (as float32, what the fused kernel reads)
    # written into the optimizer's tensor in place, and the eager schedule's state.
    captured = build_optimizer(torch.nn.Linear(2, 2), cfg, steps, captured=True)
    optimizer, table_lr = captured
    assert isinstance(optimizer, CapturableAdamW) and isinstance(table_lr, ScheduleTable)
    rate = optimizer.param_groups[0]["lr"]
    assert rate is optimizer.lr and rate.dtype == torch.float32
    assert _lrs_used(cfg, steps, *captured) == table[:-1].float().tolist()
    assert optimizer.param_groups[0]["lr"] is rate  # never replaced, only written
    assert table_lr.state_dict() == eager[1].state_dict()
    assert table_lr.get_last_lr() == eager[1].get_last_lr()
    # Its optimizer's checkpoint is an eager one's in form: numbers, the eager flags.
    groups = optimizer.state_dict()["param_groups"]
    eager_groups = eager[0].state_dict()["param_groups"]
    assert [g.keys() for g in groups] == [g.keys() for g in eager_groups]
    for group, eager_group in zip(groups, eager_groups, strict=True):
        assert {k: type(v) for k, v in group.items()} == {
            k: type(v) for k, v in eager_group.items()
        }
        assert group["lr"] == pytest.approx(eager_group["lr"], rel=1e-6)

    # A resume at step 5 of an eager run's checkpoint.
    resumed = build_optimizer(torch.nn.Linear(2, 2), cfg, steps, captured=True)[1]
    early = build_optimizer(torch.nn.Linear(2, 2), cfg, steps)[1]
    early.optimizer.step()  # (no gradients) the order the schedule expects
    for _ in range(5):
        early.step()
    resumed.load_state_dict(early.state_dict())
    assert resumed.last_epoch == 5 and float(resumed.lr) == table[5].float().item()
    assert resumed.state_dict() == early.state_dict()


def _training(images, labels, seed: int, captured: bool = False, mode: str = LOADER):
    """One worker's training as the loop prepares it on a device, here the CPU, its weights
    initialised from ``seed``: ``mode`` makes the batches from the order and runs the step
    through the capture wrapper (LOADER: the CPU's loader loop); ``captured``: the
    optimizer and schedule built for capture."""
    data = MnistData(images, labels, images[:0], labels[:0], "sample", "test")
    cfg = dataclasses.replace(CFG, seed=seed)
    return prepare_training(
        cfg,
        data,
        CPU,
        prepare_model=as_is,
        prepare_data_loader=as_is,
        capture=captured,
        step_mode=mode,
    )


def _trained(training: Training, epochs: int = 2) -> tuple[dict, list[dict]]:
    results = []
    for epoch in range(epochs):
        set_epoch(training.loader, epoch, CFG.seed)
        results.append(training.train_one_epoch())
    return training.module.state_dict(), results


def _same_weights(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name, value in a.items():
        assert torch.equal(b[name], value), name


def _same_epochs(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        for key in ("train_loss", "train_accuracy", "train_images", "train_steps"):
            assert x[key] == y[key], key


def test_the_capture_wrapper_falls_back_to_eager_on_cpu_bit_for_bit(digits):
    """Asked to capture on a CPU, the wrapper warms up (11 steps, each undone), then runs
    eagerly: the weights, losses, schedule and RNG after two epochs are today's loop's,
    exactly; so is the device-batch path without the warm-up."""
    images, labels = digits
    today = _training(images, labels, 0)
    weights, epochs = _trained(today)
    draws = torch.rand(4)
    for mode in (EAGER, CAPTURE):
        run = _training(images, labels, 0, mode=mode)
        got, got_epochs = _trained(run)
        _same_weights(weights, got)
        _same_epochs(epochs, got_epochs)
        assert run.lr == today.lr and torch.equal(torch.rand(4), draws)
        assert not run.captured and (run.steps.prepare_s > 0) == (mode == CAPTURE)
    # The captured step's own optimizer and schedule: the warm-up (which makes their state,
    # then zeroes it in place) is undone as completely.
    weights, epochs = _trained(_training(images, labels, 0, captured=True, mode=EAGER))
    got, got_epochs = _trained(_training(images, labels, 0, captured=True, mode=CAPTURE))
    _same_weights(weights, got)
    _same_epochs(epochs, got_epochs)


def test_the_warm_up_is_undone_in_place_and_a_resume_loads_into_the_same_tensors(tmp_path, digits):
    """The captured step's objects (fused AdamW with a tensor rate, the schedule table): a
    mid-epoch checkpoint of an eager-stepped run resumes, through the warm-up, to the
    uninterrupted run's weights bit for bit; loading a checkpoint keeps every tensor a graph
    would replay (same storage); the checkpoint is an eager run's in form and resumes one."""
    images, labels = digits
    run = _training(images, labels, 0, captured=True, mode=EAGER)
    set_epoch(run.loader, 0, CFG.seed)
    run.train_one_epoch()
    history = [{"epoch": 1, "val_accuracy": 0.5}]

    def at_step_3(steps, sums):
        if steps == 3:
            position = {
                "step": 3,
                "sums": [*sums.tolist(), 0.25],
                "sampler_seed": CFG.seed,
                "sampler_epoch": 1,
                "world_size": 1,
                "kind": "preemption",
            }
            ckpt.save(tmp_path, checkpoint_state(run, CFG, 1, 0.5, history, position))

    set_epoch(run.loader, 1, CFG.seed)
    uninterrupted = run.train_one_epoch(on_step=at_step_3)
    state = ckpt.resumable_state(tmp_path, CFG.to_dict())  # the driver's check passes
    groups = state["optimizer"]["param_groups"]
    eager_groups = _training(images, labels, 0).optimizer.state_dict()["param_groups"]
    assert [g.keys() for g in groups] == [g.keys() for g in eager_groups]
    assert all(isinstance(g["lr"], float) and g["fused"] is None for g in groups)

    resumed = _training(images, labels, 1, captured=True, mode=CAPTURE)
    restore(resumed, state)
    start, _ = resume_point(state, rank=0)
    set_epoch(resumed.loader, 1, CFG.seed)
    finished = resumed.train_one_epoch(start=start)  # warms up first, at step 3
    assert finished["train_steps"] == uninterrupted["train_steps"]
    assert finished["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=1e-12)
    _same_weights(run.module.state_dict(), resumed.module.state_dict())
    assert resumed.lr == run.lr

    # What a graph replays stays put when a checkpoint is loaded into it.
    optimizer, schedule = resumed.optimizer, resumed.scheduler
    held = [p for p in resumed.module.parameters()]
    held += [t for s in optimizer.state.values() for t in s.values()]
    held += [optimizer.lr, schedule.position, resumed.steps.batches.at]
    pointers = [t.data_ptr() for t in held]
    restore(resumed, ckpt.load(tmp_path))
    assert [t.data_ptr() for t in held] == pointers
    assert optimizer.param_groups[0]["lr"] is optimizer.lr and schedule.last_epoch == STEPS + 3
    loaded = ckpt.load(tmp_path)["optimizer"]["state"]
    for index, p in enumerate(resumed.module.parameters()):
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, loaded[index][key].to(value.dtype)), key

    # An eager run resumes from it too, at the rate the captured one resumes at.
    eager = _training(images, labels, 1)
    restore(eager, ckpt.load(tmp_path))
    assert eager.lr == resumed.lr


def test_a_step_mode_is_eager_or_capture():
    with pytest.raises(ValueError, match="'eager' or 'capture'"):
        GraphedStep(lambda: None, dict, lambda state: None, "graph", CPU)
    assert WARMUP_STEPS >= 11  # DDP's sampled first ten iterations, then one more


def test_train_step_is_what_the_device_steps_run(digits):
    """The device path calls the one train_step (no second copy of the step to drift)."""
    images, labels = digits
    a = _training(images, labels, 0, mode=EAGER)
    b = _training(images, labels, 0)
    set_epoch(a.loader, 0, CFG.seed)
    a.steps.batches.load_epoch()
    torch.manual_seed(3)
    a.steps.run()
    set_epoch(b.loader, 0, CFG.seed)
    x, y = next(iter(b.loader))
    torch.manual_seed(3)
    train_step(b.model, x, y, b.optimizer, b.scheduler, b.scaler, b.autocast, b.recipe)
    _same_weights(b.module.state_dict(), a.module.state_dict())


@pytest.mark.parametrize("mode", [LOADER, EAGER])
def test_an_epochs_metrics_are_summed_over_every_rank(digits, monkeypatch, mode):
    """Either steps object's epoch reports every rank's loss, hits and images (one
    all-reduce of the sums): here a stand-in second rank that trained what this one did."""
    import types

    import torch.distributed as dist

    from raytrain_mnist.nn import score

    images, labels = digits
    alone = _training(images, labels, 0, mode=mode)
    set_epoch(alone.loader, 0, CFG.seed)
    one = alone.train_one_epoch()
    paired = _training(images, labels, 0, mode=mode)  # seeded again: the same draws
    second_rank = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        get_world_size=lambda group=None: 2,
        all_reduce=lambda tensor, op=None: tensor.mul_(2),
        ReduceOp=dist.ReduceOp,
    )
    monkeypatch.setattr(score, "dist", second_rank)  # what the sums' all-reduce sees
    set_epoch(paired.loader, 0, CFG.seed)
    two = paired.train_one_epoch()
    assert two["train_images"] == 2 * one["train_images"] == 2 * STEPS * CFG.batch_size
    assert two["train_loss"] == one["train_loss"]
    assert two["train_accuracy"] == one["train_accuracy"]
