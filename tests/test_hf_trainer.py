"""A sampler and its warm-up inside the Hugging Face ``Trainer``, which nobody here wrote.

The ``Trainer`` owns the lr scheduler: it builds one (a constant one at the least) unless
given one, steps it after every optimizer step, and saves it with each checkpoint. Its
own scheduler moved lr under a ``StepSizeWarmup``, which the warm-up refuses; given the
warm-up as its scheduler (``optimizers=(sampler, warmup)``) the Trainer trains through
the warm-up, and a run resumed from a checkpoint saved half-way through the warm-up
ends where the uninterrupted run ends, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from samplers_as_optim import SGHMC, GaussianLikelihood, StepSizeWarmup, prior_param_groups

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

N = 128


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 4, generator=generator)
        noise = 0.3 * torch.randn(N, 1, generator=generator)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]]) + noise

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.likelihood = GaussianLikelihood(num_data=N)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        output = self.net(x)
        return {"loss": self.likelihood(output, labels), "logits": output}


def train(
    folder: Path, *, scheduler: bool, resume: str | None = None
) -> tuple[Regression, SGHMC, StepSizeWarmup]:
    torch.manual_seed(0)
    model = Regression()
    sampler = SGHMC(
        prior_param_groups(model, num_data=N), lr=1e-2, momentum=0.9, num_data=N, seed=3
    )
    warmup = StepSizeWarmup(sampler, steps=40, every=10)
    arguments = transformers.TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=32,
        max_steps=60,
        save_steps=20,
        lr_scheduler_type="constant",
        logging_steps=20,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=Data(),
        optimizers=(sampler, warmup if scheduler else None),
    )
    trainer.train(resume_from_checkpoint=resume)
    return model, sampler, warmup


def state(model: nn.Module) -> dict[str, Any]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.slow
def test_the_trainers_own_scheduler_is_refused_under_the_warm_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"during the warm-up only it sets lr"):
        train(tmp_path, scheduler=False)


@pytest.mark.slow
def test_the_warm_up_as_the_trainers_scheduler_resumes_from_a_checkpoint_exactly(
    tmp_path: Path,
) -> None:
    whole, sampler, warmup = train(tmp_path / "whole", scheduler=True)
    assert warmup.done and len(warmup.history) == 4
    assert sampler.param_groups[0]["step"] == 60
    assert warmup.get_last_lr() == [group["lr"] for group in sampler.param_groups]
    assert warmup.get_last_lr() != warmup.start  # adapted
    checkpoint = tmp_path / "whole" / "checkpoint-20"  # half-way through the warm-up
    assert checkpoint.is_dir()
    resumed, resumed_sampler, resumed_warmup = train(
        tmp_path / "resumed", scheduler=True, resume=str(checkpoint)
    )
    assert resumed_sampler.param_groups[0]["step"] == 60
    assert resumed_warmup.seen == warmup.seen and resumed_warmup.history == warmup.history
    assert resumed_warmup.get_last_lr() == warmup.get_last_lr()
    for name, value in state(whole).items():
        assert torch.equal(state(resumed)[name], value), name
