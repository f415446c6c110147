"""The shim's step token budget (`--max-num-batched-tokens`, engine_shim/scheduler.py): every
decode runs, prompts go first come first served while the budget lasts (at least one), and
greedy output is what an engine without a budget gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdgate.engine_shim.engine import Engine, EngineConfig
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.sampler import SamplingParams
from pdgate.engine_shim.scheduler import Work, within_budget
from pdgate.engine_shim.sequence import GenerateRequest


def _work(name: int, tokens: int) -> Work:
    # Only `ids` matters to the budget; `seq` names the work item here.
    return Work(seq=name, ids=tuple(range(tokens)), start=0, blocks=(),  # type: ignore[arg-type]
                banned=())


def _names(work: list[Work]) -> list[int]:
    return [w.seq for w in work]  # type: ignore[misc]


def test_decodes_always_run_and_prompts_go_in_arrival_order_while_the_budget_lasts() -> None:
    work = [_work(0, 1), _work(1, 30), _work(2, 1), _work(3, 20), _work(4, 5)]
    assert _names(within_budget(work, 60)) == [0, 1, 2, 3, 4]  # 2 + 30 + 20 + 5 = 57
    # 2 decodes + 30 leave 8: the 20-token prompt waits, and the 5-token one behind it
    # does not jump it.
    assert _names(within_budget(work, 40)) == [0, 1, 2]


def test_a_prompt_longer_than_the_budget_still_runs_alone() -> None:
    work = [_work(0, 100), _work(1, 10), _work(2, 1)]
    assert _names(within_budget(work, 16)) == [0, 2]


async def _answers(engine: Engine, prompts: list[tuple[int, ...]]) -> list[str]:
    async def one(i: int, prompt: tuple[int, ...]) -> str:
        req = GenerateRequest(request_id=f"r{i}", prompt_ids=prompt, max_tokens=6,
                              sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        text = ""
        async with await engine.open(req) as stream:
            async for out in stream:
                text += out.text
        return text

    await engine.start()
    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.stop()


async def test_budgeted_steps_give_the_same_greedy_answers(tiny_model_dir: Path) -> None:
    prompts = [tuple((i * 7 + j) % 400 + 3 for j in range(24 + 4 * i)) for i in range(5)]

    def engine(budget: int) -> Engine:
        return Engine.load(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=128,
                                        max_num_batched_tokens=budget), ShimMetrics.create())

    want = await _answers(engine(0), prompts)
    assert await _answers(engine(30), prompts) == want
