"""PredictionWriter: per-rank shards written as predictions come, read back in dataset order (2 ranks: tests/distributed)."""

from __future__ import annotations

import pytest
import torch

import cadence
from cadence.callbacks.prediction_writer import PredictionWriter, read_predictions


class Index(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return (torch.tensor([float(i)]),)


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(3.0))

    def forward(self, x):
        return x * self.scale, x.long()


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_read_back_in_dataset_order(tmp_path, shuffle):
    writer = PredictionWriter(dir=str(tmp_path / "p"), batches_per_file=2)
    engine = cadence.Engine(
        Pair(), callbacks=[writer], seed=0, predict={"batch_size": 3, "shuffle": shuffle}, device="cpu"
    )
    engine.predict(Index())
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["rank00000-00000.pt", "rank00000-00001.pt"]
    scaled, index = read_predictions(tmp_path / "p")
    assert torch.equal(index[:, 0], torch.arange(10))
    assert torch.equal(scaled[:, 0], 3 * torch.arange(10, dtype=torch.float32))
    assert not scaled.requires_grad


def test_a_new_predict_replaces_the_ranks_old_shards(tmp_path):
    writer = PredictionWriter(dir=str(tmp_path), batches_per_file=1)
    engine = cadence.Engine(Pair(), callbacks=[writer], seed=0, predict={"batch_size": 5}, device="cpu")
    engine.predict(Index())
    engine.predict(torch.utils.data.Subset(Index(), range(4)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank00000-00000.pt"]
    assert len(read_predictions(tmp_path)[1]) == 4


def test_the_default_folder_is_in_the_run_directory(tmp_path):
    writer = PredictionWriter()
    engine = cadence.Engine(Pair(), callbacks=[writer], seed=0, workspace=str(tmp_path), device="cpu")
    engine.predict(Index())
    assert writer.directory == engine.run_dir / "predictions"
    assert len(read_predictions(writer.directory)[0]) == 10


def test_reading_an_empty_folder_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no prediction shards \(rank\*-\*\.pt\) in"):
        read_predictions(tmp_path)
