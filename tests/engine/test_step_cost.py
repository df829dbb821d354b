"""The step cost model: calibration recovers a known linear cost; the prefill budget fills the target."""
from __future__ import annotations

from engine.step_cost import StepCost, StepTimeTarget, calibrate


def test_calibration_recovers_a_linear_cost():
    now = [0.0]  # a virtual clock: the test asserts arithmetic, not wall time

    def forward(prefill: int, context: int) -> None:  # 20 ms + 0.1 ms per prefill token + 5 us per context token
        now[0] += 0.020 + prefill * 1e-4 + context * 5e-6

    cost = calibrate(forward, prefill_tokens=100, context_tokens=1001, repeats=2, clock=lambda: now[0])
    assert abs(cost.per_prefill_token_s - 1e-4) < 1e-9
    assert abs(cost.per_context_token_s - 5e-6) < 1e-9
    assert abs(cost.fixed_s - 0.020005) < 1e-9


def test_prefill_budget_fills_the_target_and_never_starves_a_prefill():
    cost = StepCost(fixed_s=0.020, per_prefill_token_s=0.001, per_context_token_s=0.00001)
    # 50 ms target, 1,000 context tokens of decodes: 50 - 20 - 10 = 20 ms left = 20 prefill tokens
    assert cost.prefill_budget(0.050, 1000) == 20
    assert cost.predict(20, 1000) == 0.050
    assert cost.prefill_budget(0.010, 1000) == 1  # target below the decode floor: still one token
    assert cost.prefill_budget(0.010, 1000, minimum=16) == 16


def test_calibrates_on_the_real_runner(tiny_llama_dir):
    from engine import LLM
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    cost = calibrate(llm.core.runner.calibration_step, prefill_tokens=32, context_tokens=128, repeats=1)
    assert cost.fixed_s > 0 and cost.per_prefill_token_s >= 0 and cost.per_context_token_s >= 0
    # the pool's scratch K/V is overwritten by real requests afterwards: output is unaffected
    assert llm.generate([1, 2, 3, 4, 5], None)[0].token_ids


def test_the_target_corrects_the_model_by_the_steps_it_sees():
    cost = StepCost(fixed_s=0.020, per_prefill_token_s=0.001, per_context_token_s=0.0)
    target = StepTimeTarget(cost, target_s=0.100, minimum=16)
    assert target.prefill_budget(0) == 80  # the calibrated model: 20 ms + 80 x 1 ms = 100 ms
    for _ in range(30):  # real steps run twice what the model predicts (more decodes, other load)
        target.observe(40, 0, 2 * cost.predict(40, 0))
    assert abs(target.scale - 2.0) < 1e-3
    assert target.prefill_budget(0) == 30  # 100 ms / 2 = 50 ms: 20 ms + 30 x 1 ms
    assert StepTimeTarget(cost, 0.010, minimum=16).prefill_budget(0) == 16  # never below one block
