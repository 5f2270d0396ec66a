"""Exact resume for the user's own `torch.utils.data.DataLoader`: its shuffle is replayed, not redrawn."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.checkpoint.file_store import FileStore
from cadence.engine.loader_checks import fork_can_deadlock
from tests.callbacks import checkpoint_workers as workers
from tests.callbacks.test_resume import assert_bitwise, in_child, load

pytestmark = pytest.mark.timeout(150)

KINDS = ("shuffle", "generator", "replacement")


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    """The uninterrupted runs, one per (loader kind, num_workers)."""
    root = tmp_path_factory.mktemp("plain-reference")
    found = {}
    for kind in KINDS:
        for n in (0, 2):
            out = root / f"{kind}-{n}.pt"
            in_child(workers.plain_run, str(root / f"ckpt-{kind}-{n}"), str(out), kind=kind, workers=n)
            found[(kind, n)] = load(out)
    assert len(found[("shuffle", 0)]["losses"]) == 2 * workers.PLAIN_STEPS
    return found


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stop", [6, 8])
def test_a_plain_dataloader_resumes_exactly(
    tmp_path: Path, references: dict[Any, Any], kind: str, num_workers: int, stop: int
) -> None:
    # Step 6 is in the middle of the second epoch (4 of its 8 batches seen): the epoch is replayed from its
    # saved start. Step 8 ends it: the next epoch's shuffle must come from the saved generator / RNG.
    directory = str(tmp_path / "ckpt")
    in_child(workers.plain_run, directory, str(tmp_path / "first.pt"), kind=kind, workers=num_workers, stop=stop)
    first = load(tmp_path / "first.pt")
    saved = FileStore(directory).read("latest")
    assert (saved["engine"]["epoch"], saved["engine"]["batch_in_epoch"]) == ((1, 4) if stop == 6 else (2, 0))
    in_child(workers.plain_run, directory, str(tmp_path / "resumed.pt"), kind=kind, workers=num_workers)
    resumed = load(tmp_path / "resumed.pt")
    assert resumed["restored_from"] is not None
    assert_bitwise(references[(kind, num_workers)], first, resumed)


@pytest.mark.parametrize(
    "num_workers",
    [
        0,
        pytest.param(
            2,
            marks=pytest.mark.skipif(
                fork_can_deadlock(),
                reason="on this Python a DataLoader worker forked beside gloo's threads hangs now and then in os.fork "
                "(CPython gh-112275, fixed in 3.10.15 and 3.11.10; Cadence warns at setup): about 1 run in 25 "
                "here; workers with forkserver cost ~50 s more, and each part is tested on its own (workers on "
                "one process above, the distributed sampler with num_workers=0)",
            ),
        ),
    ],
)
def test_a_plain_dataloader_with_a_distributed_sampler_resumes_exactly_on_two_ranks(
    tmp_path: Path, num_workers: int
) -> None:
    def run(directory: Path, stop: int | None = None) -> dict[str, Any]:
        return cadence.launch(
            workers.plain_run, str(directory), None, kind="distributed", workers=num_workers, stop=stop,
            backend="auto", nprocs=2, start_method="fork", timeout=90,
        )  # fmt: skip

    reference = run(tmp_path / "reference")
    first = run(tmp_path / "ckpt", stop=5)  # 2 steps per epoch on each rank: step 5 is mid-epoch
    saved = FileStore(tmp_path / "ckpt").read("latest")["engine"]
    assert (saved["epoch"], saved["batch_in_epoch"]) == (2, 2)
    resumed = run(tmp_path / "ckpt")
    assert resumed["restored_from"] is not None
    assert_bitwise(reference, first, resumed)


def test_persistent_workers_warn_at_setup_naming_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    dataset = workers.NoisyDataset()
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=1, persistent_workers=True)
    model = torch.nn.Linear(6, 1)
    with caplog.at_level(logging.WARNING, logger="cadence"):
        engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, seed=0, device="cpu")
    engine.close()
    messages = [r.getMessage() for r in caplog.records if "persistent_workers" in r.getMessage()]
    assert len(messages) == 1, [r.getMessage() for r in caplog.records]
    assert "persistent_workers=False" in messages[0] and "resume" in messages[0]


@pytest.mark.parametrize("strict", [True, False])
def test_a_position_saved_for_another_kind_of_train_data_is_refused_or_restarts_the_epoch(
    tmp_path: Path, strict: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from cadence.callbacks.checkpoint import Checkpoint
    from cadence.checkpoint.store import CheckpointError

    def engine(data: Any, **checkpoint: Any) -> cadence.Engine:
        model = torch.nn.Linear(6, 1)
        return cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=torch.nn.functional.mse_loss,
            callbacks=[Checkpoint(dir=str(tmp_path), interval=0, **checkpoint)], seed=0,
            device="cpu",
        )  # fmt: skip

    first = engine(workers.plain_loader("generator", 0))
    first.fit(steps=3)  # mid-epoch: 8 batches per epoch
    assert FileStore(tmp_path).read("latest")["data"]["train"][0]["cadence.replay"] == 1
    dataset = workers.NoisyDataset()
    if strict:
        with pytest.raises(CheckpointError, match="train position was saved for a loader the engine replays"):
            engine(dataset, resume=str(tmp_path / "latest")).fit(steps=0)
        return
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        resumed = engine(dataset, resume=str(tmp_path / "latest"), strict=False)
        resumed.fit(steps=0)
    assert "the interrupted epoch restarts" in caplog.text
    assert (resumed.state.step, resumed.state.batch_in_epoch) == (3, 0)
