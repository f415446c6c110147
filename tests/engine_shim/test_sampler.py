"""Next-token choice: greedy is argmax, seeded sampling repeats, filters narrow the choice."""

from __future__ import annotations

import pytest
import torch

from pdgate.engine_shim.sampler import Sampler, SamplingParams


def _logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(params: SamplingParams, n: int = 50) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(_logits(i)) for i in range(n)]


def test_greedy_is_argmax_and_ignores_seed() -> None:
    for i in range(10):
        row = _logits(i)
        assert Sampler(SamplingParams(temperature=0, seed=i)).sample(row) == int(row.argmax())
    row = torch.tensor([0.0, 5.0, 5.0, 1.0])
    assert Sampler(SamplingParams(temperature=0)).sample(row) == 1  # ties: lowest id


def test_same_seed_same_tokens_different_seed_differs() -> None:
    a = _draw(SamplingParams(temperature=1.0, seed=7))
    assert a == _draw(SamplingParams(temperature=1.0, seed=7))
    assert a != _draw(SamplingParams(temperature=1.0, seed=8))
    greedy = [int(_logits(i).argmax()) for i in range(50)]
    assert a != greedy  # it really samples


def test_tiny_top_p_and_top_k_one_pick_argmax() -> None:
    greedy = [int(_logits(i).argmax()) for i in range(50)]
    assert _draw(SamplingParams(temperature=2.0, top_p=1e-6, seed=1)) == greedy
    assert _draw(SamplingParams(temperature=2.0, top_k=1, seed=1)) == greedy


def test_top_k_keeps_only_the_k_most_likely() -> None:
    row = _logits(3)
    allowed = set(torch.topk(row, 3).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    seen = {sampler.sample(row) for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_nucleus() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    assert {sampler.sample(row) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"seed": "x"},
    ],
)
def test_invalid_params_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logits_must_be_one_row() -> None:
    with pytest.raises(ValueError, match="1-D"):
        Sampler(SamplingParams(temperature=0)).sample(torch.zeros(2, 4))
